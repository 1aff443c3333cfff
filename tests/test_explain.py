"""The `kiln explain` report (CompiledModule.explain)."""

import re

import pytest
import torch

import kiln
from kiln.dispatch.cost import ZERO, plan_costs
from kiln.explain import human_bytes, human_flops
from kiln.ir.symbolic import bounds_of, evaluate


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        h = torch.nn.functional.silu(self.up(x))  # the line the report must show
        return self.down(h).softmax(-1)


@pytest.fixture(scope="module")
def exe():
    T = kiln.Dim("tokens", min=2, max=100)
    return kiln.compile(Block(), (torch.randn(6, 16),), dynamic_shapes=({0: T},))


def test_regions_with_kinds_shapes_and_source_lines(exe):
    text = exe.explain()
    (sym,) = exe.plan.symbols
    assert f"{sym} (tokens) in [2, 100]   example 6" in text
    for r in exe.plan.regions:
        assert re.search(rf"^{r.name} {r.kind.value}", text, re.M), r.name
    assert f"f32[{sym}, 32]" in text
    assert "test_explain.py:" in text and "the line the report must show" in text


def test_costs_at_example_and_at_the_upper_bound(exe):
    text = exe.explain()
    total = sum(plan_costs(exe.plan).values(), ZERO)
    (sym,) = exe.plan.symbols
    at_example = human_bytes(evaluate(total.bytes, {sym: 6}))
    at_max = human_bytes(bounds_of(total.bytes, exe.plan.symbols).hi)
    flops_max = human_flops(evaluate(total.flops, {sym: 100}))
    tail = text[text.index("\ntotal\n"):]
    assert f"bytes {at_example} at example, {at_max} at max" in tail
    assert f"{flops_max} at max" in tail


def test_memory_report_matches_the_memory_plan(exe):
    text = exe.explain()
    mem = exe.program.mem
    (sym,) = exe.plan.symbols
    for env, what in (({sym: 6}, "example"), ({sym: 100}, "max")):
        assert (f"at {what} sizes: peak planned {human_bytes(mem.peak_bytes(env))} vs "
                f"{human_bytes(mem.total_bytes(env))} for all intermediates") in text


def test_unbounded_dims_are_said_to_be_unbounded():
    exe = kiln.compile(Block(), (torch.randn(6, 16),),
                       dynamic_shapes=({0: kiln.Dim("T", min=2)},))
    text = exe.explain()
    assert "(unbounded)" in text and "unbounded at max" in text
    assert "at max sizes: unbounded" in text


def test_notes_and_kernels():
    exe = kiln.compile(Block(), (torch.randn(6, 16),), target="interpret",
                       options={"tune": "none"})
    plain, full = exe.explain(), exe.explain(kernels=True)
    for r in exe.plan.regions:
        for note in r.notes:
            assert f"note: {note}" in plain
        assert exe.program.kplan.kernels[r.name].describe().splitlines()[0] in full
    assert "kernel:" not in plain
    assert "symbols: none" in plain and "at max" not in plain.split("total")[0]


@pytest.mark.parametrize("n,text", [(0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"),
                                    (3 * 2**20 + 2**19, "3.5 MiB"), (5 * 2**40, "5.12e+03 GiB")])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize("n,text", [(0, "0"), (999, "999"), (1500, "1.5 K"),
                                    (2_000_000_000, "2 G")])
def test_human_flops(n, text):
    assert human_flops(n) == text


def test_a_moe_region_shows_its_routing_bound():
    """Tokens per expert are data-dependent; the report gives their bound by
    construction, N * k (the sorted row buffer's size), at the example and at max."""
    from kiln.ops import moe_experts, moe_experts_fp8, quantize_experts

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.randn(6, 5, 16))
            self.up = torch.nn.Parameter(torch.randn(6, 5, 16))
            self.down = torch.nn.Parameter(torch.randn(6, 16, 5))

        def forward(self, x, weights, ids):
            return moe_experts(x, weights, ids, self.gate, self.up, self.down)

    T = kiln.Dim("tokens", min=1, max=300)
    args = (torch.randn(7, 16), torch.rand(7, 3), torch.randint(0, 6, (7, 3)))
    exe = kiln.compile(Experts(), args, dynamic_shapes=({0: T},) * 3)
    (sym,) = exe.plan.symbols
    text = exe.explain()
    assert (f"routing: 6 experts, k = 3; rows per expert <= N*k = 3*{sym} (21 at example, "
            "900 at max), the row buffer's size") in text
    static = kiln.compile(Experts(), args).explain()
    assert "rows per expert <= N*k = 21, the row buffer's size" in static

    class Fp8Experts(torch.nn.Module):  # the fp8 form: the same routing
        def __init__(self):
            super().__init__()
            dense = Experts()
            self.w = torch.nn.ParameterList(
                [torch.nn.Parameter(t, requires_grad=False) for name in ("gate", "up", "down")
                 for t in quantize_experts(getattr(dense, name).data)])

        def forward(self, x, weights, ids):
            return moe_experts_fp8(x, weights, ids, *self.w)

    fp8 = kiln.compile(Fp8Experts(), args).explain()
    assert "routing: 6 experts, k = 3; rows per expert <= N*k = 21" in fp8


def test_compile_time_by_phase(exe, tmp_path):
    """The compile records where its time went; a loaded module has no compile to show."""
    t = exe.compile_timings
    for key in ("import/export", "import/export/capture", "import/export/decompose",
                "graph/cse", "codegen/select_kernels", "schedule/schedule", "verify"):
        assert t[key] >= 0.0, key
    assert t["import/export/capture"] + t["import/export/decompose"] <= t["import/export"]
    text = exe.explain(timings=True)
    assert "compile time" in text and "    decompose: " in text
    assert "compile time" not in exe.explain()  # the plan's report, as an artifact's
    exe.save(tmp_path / "m.kiln")
    assert "compile time" not in kiln.load(tmp_path / "m.kiln").explain(timings=True)
