"""Loads issued early (codegen/templates/load_order.py): a load moves up to just after
what it depends on and no further; a loop's invariant loads leave the loop."""

from kiln.codegen.templates.load_order import invariant_loads, loads_first


def test_a_load_moves_up_to_the_last_line_it_depends_on():
    lines = ["a = tl.arange(0, 16)",
             "t0 = tl.load(p0 + a)",
             "t1 = t0 * 2.0",
             "t2 = tl.load(p1 + a)",   # reads a only: up beside t0
             "t3 = tl.max(t1, 0)",
             "t4 = tl.load(p2 + t3)",  # reads t3: stays after it
             'f = tl.full([16], float("-inf"), tl.float32)',
             "t5 = tl.load(p3 + 0)"]   # reads nothing: up, but after the loads before it
    assert loads_first(lines) == [
        "a = tl.arange(0, 16)",
        "t0 = tl.load(p0 + a)",
        "t2 = tl.load(p1 + a)",
        "t1 = t0 * 2.0",
        "t3 = tl.max(t1, 0)",
        "t4 = tl.load(p2 + t3)",
        "t5 = tl.load(p3 + 0)",
        'f = tl.full([16], float("-inf"), tl.float32)']


def test_no_load_crosses_a_block_a_store_or_a_use_of_its_name():
    lines = ["x = 1",
             "if KV_SPLIT > 1:",
             "    x = 2",
             "y = x + 1",
             "tl.store(q, y)",
             "z = t9 + 1",            # reads the name the load assigns
             "t9 = tl.load(p + 0)"]
    assert loads_first(lines) == lines
    assert loads_first(["x = 1", "t9 = tl.load(p)", "u = 2", "t8 = tl.load(p + x)"]) == [
        "t9 = tl.load(p)", "x = 1", "t8 = tl.load(p + x)", "u = 2"]


def test_only_loads_reading_nothing_the_loop_defines_leave_it():
    body = ["n = start_n + tl.arange(0, 16)",
            "t1 = tl.load(pos + 0)",            # invariant
            "t2 = n <= t1",
            "t3 = tl.load(k + n)",              # reads n
            "t4 = tl.load(m + rows2, mask=ok)"]  # reads names defined before the loop
    hoisted, rest = invariant_loads(body, {"start_n"})
    assert hoisted == ["t1 = tl.load(pos + 0)", "t4 = tl.load(m + rows2, mask=ok)"]
    assert rest == ["n = start_n + tl.arange(0, 16)", "t2 = n <= t1", "t3 = tl.load(k + n)"]
    # a body with a block in it gives up nothing
    assert invariant_loads(body + ["if c:", "    t5 = 1"], {"start_n"}) == (
        [], body + ["if c:", "    t5 = 1"])
