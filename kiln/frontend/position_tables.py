"""A table read at positions counted by an arange over the length must hold them all.

GPT-2's `wpe(arange(T))` (any learned position table indexed by positions made from
the length) is valid only while T fits the table; eager raises IndexError past it.
torch.export records no guard (an index is a value, not a size), and kiln's generated
kernels do not check indices, so a Dim whose max exceeds the table compiled and then
read past it in silence. Refused at import, naming the table, the dim and the line.
"""

from __future__ import annotations

from torch import fx

from kiln.errors import ShapeError, library_frame
from kiln.ir.graph import KilnGraph, shape_of, where
from kiln.ir.symbolic import as_dim, bounds_of

_THROUGH = {"aten.unsqueeze.default", "aten.view.default", "aten.reshape.default",
            "aten.expand.default", "aten.clone.default", "aten.alias.default",
            "aten._to_copy.default"}
_ARANGE = {"aten.arange.default", "aten.arange.start", "aten.arange.start_step"}


def _int_bounds(x, kg: KilnGraph):
    """(lo, hi) of an int argument: a constant, or a size node's symbolic value."""
    if isinstance(x, int):
        return x, x
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if val is None or isinstance(val, float):
        return None
    b = bounds_of(as_dim(val), kg.symbols)
    return (b.lo, b.hi) if b.hi is not None else None


def _highest(node, kg: KilnGraph) -> tuple[int, int, fx.Node] | None:
    """The highest value an index can take when it is an arange (step 1) shifted by
    constants and viewed: (value, the shift, the arange); None for any other index."""
    offset = 0
    while isinstance(node, fx.Node) and node.op == "call_function":
        target = str(node.target)
        if target in _THROUGH:
            node = node.args[0]
        elif target in ("aten.add.Tensor", "aten.add.Scalar") and len(node.args) == 2 \
                and isinstance(node.args[1], int) and not node.kwargs:
            offset, node = offset + node.args[1], node.args[0]
        elif target in _ARANGE:
            args = list(node.args)
            start, end = (0, args[0]) if target == "aten.arange.default" else args[:2]
            if len(args) > 2 and args[2] != 1:
                return None
            s, e = _int_bounds(start, kg), _int_bounds(end, kg)
            if s is None or e is None or isinstance(end, int):
                return None  # a static arange: eager meets the same index
            return offset + e[1] - 1, offset, node
        else:
            return None
    return None


def check_position_tables(kg: KilnGraph) -> None:
    """Refuse a table read at arange positions its rows do not cover for every length
    the declared dims allow."""
    for node in kg.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target == "aten.embedding.default":
            table, index = node.args[0], node.args[1]
        elif target == "aten.index.Tensor" and len(node.args[1]) == 1:
            table, index = node.args[0], node.args[1][0]
        else:
            continue
        rows = shape_of(table)[0] if isinstance(table, fx.Node) else None
        found = _highest(index, kg) if isinstance(rows, int) else None
        if found is None or found[0] < rows:
            continue
        highest, offset, arange = found
        length = as_dim(arange.meta["val"].shape[0])
        syms = [] if isinstance(length, int) else sorted(s.name for s in length.free_symbols)
        named = ", ".join(f'dim "{kg.dim_names[s]}" ({s})' if s in kg.dim_names else f"dim {s}"
                          for s in syms) or "a dynamic dim"
        state = {i.name: i.target for i in kg.inputs if i.target}
        raise ShapeError(
            f"the table {state.get(table.name, table.name)} ({rows} rows) is read at "
            f"positions counted from the length, up to {highest}: {named} allows "
            "lengths past the table",
            where=where(node) or library_frame(node.meta.get("stack_trace")),
            hint=f"give that Dim max={rows - offset} or less (eager raises IndexError past "
            "the table; compiled kernels do not check indices), or use a config with a "
            "larger position table")
