"""Where a sharded axis goes through a view op (and back), for sharding propagation.

A view moves no data, so a sharded axis survives it when the axis maps to one axis on
the other side and stays the outermost of its reshape group (splitting heads*dim into
heads, dim keeps a split of the first; merging keeps a split of the outer axis). None
means it does not survive: the value is gathered before the view.
"""

from __future__ import annotations

import torch.fx as fx

from kiln.ir.ops import norm_axis, op_name
from kiln.ir.reshape import groups
from kiln.parallel.sharding import Sharding

VIEW_TARGETS = {
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.permute.default", "aten.transpose.int", "aten.t.default", "aten.expand.default",
    "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.squeeze.default", "aten.slice.Tensor", "aten.select.int", "aten.alias.default",
    "aten.detach.default", "aten.clone.default", "aten._to_copy.default",
}
RESHAPE_TARGETS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}


def _reshape(src, dst, axis: int, forward: bool) -> int | None:
    pairs = groups(src, dst)
    if pairs is None:
        return None
    for gi, gj in pairs:
        here, there = (gi, gj) if forward else (gj, gi)
        if axis in here:
            return there[0] if axis == here[0] else None
    return None


def _squeezed(node: fx.Node, in_rank: int) -> list[int]:
    name = op_name(node.target)
    if name == "aten.squeeze.dim":
        return [norm_axis(node.args[1], in_rank)]
    if name == "aten.squeeze.dims":
        return [norm_axis(d, in_rank) for d in node.args[1]]
    shape = node.args[0].meta["val"].shape
    return [i for i, d in enumerate(shape) if d == 1]


def map_axis(node: fx.Node, axis: int, forward: bool = True) -> int | None:
    """The axis of `node`'s output (forward) or input (backward) that `axis` becomes."""
    name = op_name(node.target)
    src = tuple(node.args[0].meta["val"].shape)
    dst = tuple(node.meta["val"].shape)
    rank_in, rank_out = len(src), len(dst)
    if name in RESHAPE_TARGETS:
        return _reshape(src, dst, axis, forward)
    if name in ("aten.alias.default", "aten.detach.default", "aten.clone.default",
                "aten._to_copy.default"):
        return axis
    if name == "aten.permute.default":
        dims = [norm_axis(d, rank_in) for d in node.args[1]]
        return dims.index(axis) if forward else dims[axis]
    if name in ("aten.transpose.int", "aten.t.default"):
        a, b = ((0, 1) if name == "aten.t.default"
                else (norm_axis(node.args[1], rank_in), norm_axis(node.args[2], rank_in)))
        return b if axis == a else a if axis == b else axis
    if name == "aten.expand.default":
        lead = rank_out - rank_in
        if forward:
            return axis + lead
        return axis - lead if axis >= lead and src[axis - lead] != 1 else None
    if name == "aten.unsqueeze.default":
        d = norm_axis(node.args[1], rank_out)
        if forward:
            return axis + (axis >= d)
        return None if axis == d else axis - (axis > d)
    if name.startswith("aten.squeeze"):
        gone = _squeezed(node, rank_in)
        if forward:
            return None if axis in gone else axis - sum(g < axis for g in gone)
        kept = [i for i in range(rank_in) if i not in gone]
        return kept[axis]
    if name == "aten.slice.Tensor":
        d = norm_axis(node.args[1] if len(node.args) > 1 else 0, rank_in)
        return None if axis == d else axis
    if name == "aten.select.int":
        d = norm_axis(node.args[1], rank_in)
        if forward:
            return None if axis == d else axis - (axis > d)
        return axis + (axis >= d)
    return None


def map_sharding(node: fx.Node, s: Sharding, forward: bool = True) -> Sharding | None:
    """`s` carried through the view op `node`; None if the sharded axis does not survive."""
    if not s.is_shard:
        return s
    axis = map_axis(node, s.axis, forward)
    if axis is None:
        return None
    if op_name(node.target) in RESHAPE_TARGETS:
        src = node.args[0].meta["val"].shape if forward else node.meta["val"].shape
        dst = node.meta["val"].shape if forward else node.args[0].meta["val"].shape
        if not isinstance(dst[axis], int) or dst[axis] % s.parts:
            return None  # fewer heads than parts: the cut would fall inside a head
        if s.segments and src[s.axis] != dst[axis]:
            return None  # a fused axis keeps its segments only if it is not regrouped
    return Sharding("shard", axis, s.parts, s.segments)
