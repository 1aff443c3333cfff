"""How finely the output of a column-parallel matmul can be cut: a look ahead.

A projection's output features are cut across ranks, and later views regroup them
into heads: q_proj's 4096 become 32 heads of 128. The cut must fall between heads, so
the number of parts is the largest divisor of T that every view downstream keeps
whole (8 KV heads under TP16 give 8 parts: pairs of ranks share a KV head). A fused
projection (q, k and v in one weight, sliced apart in forward) is cut per segment:
each rank takes its block of q, of k and of v, so the slices stay local.
"""

from __future__ import annotations

import torch.fx as fx

from kiln.errors import ShapeError
from kiln.ir.graph import where
from kiln.ir.ops import SPLITS, bind_args, norm_axis, op_name
from kiln.parallel.shard_rules import segment_piece, shape, slice_span
from kiln.parallel.sharding import Sharding, divides
from kiln.parallel.view_axes import VIEW_TARGETS, map_axis, map_sharding

_MAX_DEPTH = 16  # views between a projection and the op that uses its heads


def _split_dim(node: fx.Node) -> int:
    return norm_axis(bind_args(node).get("dim", 0), len(shape(node.args[0])))


def fused_segments(node: fx.Node, axis: int, depth: int = 0) -> tuple[int, ...] | None:
    """The sizes of the pieces that slices or a split cut `node`'s `axis` into, if they
    cover it exactly (found through views); None for an unfused projection."""
    users = list(node.users)
    splits = [u for u in users if op_name(u.target) in SPLITS]
    if splits and _split_dim(splits[0]) == axis:
        return tuple(v.shape[axis] for v in splits[0].meta["val"])
    slices = [u for u in users if op_name(u.target) == "aten.slice.Tensor"
              and norm_axis(bind_args(u)["dim"], len(shape(node))) == axis]
    if len(slices) >= 2 and len(slices) == len(users):
        size = shape(node)[axis]
        spans = sorted(slice_span(u, size) for u in slices)
        if spans[0][0] == 0 and spans[-1][1] == size and all(
                a[1] == b[0] for a, b in zip(spans, spans[1:])):
            return tuple(b - a for a, b in spans)
    if len(users) == 1 and depth < _MAX_DEPTH:
        (u,) = users
        if op_name(u.target) in VIEW_TARGETS and op_name(u.target) != "aten.slice.Tensor":
            probe = map_sharding(u, Sharding("shard", axis, 1))
            if probe is not None:
                return fused_segments(u, probe.axis, depth + 1)
    return None


def blocking_size(node: fx.Node, s: Sharding, depth: int = 0) -> int | None:
    """None if every view downstream of `node` keeps the cut `s` (whole heads per
    part); else the size of the axis that cannot be cut that way (a head count)."""
    if depth > _MAX_DEPTH:
        return None
    for u in node.users:
        name = op_name(u.target)
        if name in SPLITS:
            if _split_dim(u) == s.axis:
                sizes = tuple(v.shape[s.axis] for v in u.meta["val"])
                if s.segments != sizes:
                    return min(sizes)
            continue
        if name not in VIEW_TARGETS:
            continue
        if name == "aten.slice.Tensor" and not s.segments and map_axis(u, s.axis) is None:
            continue  # a slice across the cut (a padded vocabulary's): gathered before it
        nxt = segment_piece(u, s) if name == "aten.slice.Tensor" and s.segments \
            else map_sharding(u, s)
        if nxt is None:
            axis = map_axis(u, s.axis)
            return shape(u)[axis] if axis is not None else shape(node)[s.axis]
        found = blocking_size(u, nxt, depth + 1)
        if found is not None:
            return found
    return None


def column_parts(mm: fx.Node, tp: int, axis: int = 1) -> tuple[int, tuple[int, ...] | None]:
    """(parts, segments) for cutting the output features (`axis`: 1 for a matmul, the
    last for an fp8 linear) of the projection `mm`.

    Fewer parts than ranks only when there are fewer heads than ranks and the ranks
    divide evenly among them (KV heads under a large T); a head count or width that
    T does not divide is the user's error, not a silent replication.
    """
    segs = fused_segments(mm, axis)
    size = shape(mm)[axis]
    full = Sharding("shard", axis, tp, segs)
    blocked = blocking_size(mm, full)
    if blocked is None and divides(size, full):
        return (tp, segs)
    if blocked is None:
        blocked = next(n for n in (segs or (size,)) if n % tp)
    if not isinstance(blocked, int) or blocked >= tp or tp % blocked:
        raise ShapeError(
            f"tensor parallelism over {tp} ranks cannot cut the {size} output features of "
            f"this projection: {blocked} (heads or width) is not divisible by {tp}",
            where=where(mm),
            hint=f"choose a tp that divides {blocked} (only key/value heads may be fewer "
            "than tp, when tp is a multiple of them)")
    s = Sharding("shard", axis, blocked, segs)
    if divides(size, s) and blocking_size(mm, s) is None:
        return (blocked, segs)
    return (1, None)
