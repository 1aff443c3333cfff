"""Per-op sharding rules: from the inputs' shardings, what each input must be and what
the output is.

A rule returns a Decision: `wants` (input node -> the sharding the op needs it in; the
pass gets it there, for free when the input is a weight not yet cut, else with a local
slice or a collective) and `out`. Ops without a rule take every input replicated and
produce a replicated output: always correct, only slower, so an op nobody taught kiln
about never breaks a tensor-parallel plan.
"""

from __future__ import annotations

import torch.fx as fx

from kiln.errors import ShapeError
from kiln.ir.graph import where
from kiln.ir.ops import (
    SDPA_FORMS,
    SPLITS,
    OpCategory,
    bind_args,
    category,
    norm_axis,
    op_name,
    reduction_dims,
)
from kiln.parallel.decision import Decision, replicated, shape, tensor_inputs
from kiln.parallel.kiln_op_rules import RULES as KILN_OP_RULES
from kiln.parallel.sharding import PARTIAL, REPLICATE, Sharding, divides, shard
from kiln.parallel.view_axes import VIEW_TARGETS, map_sharding


def slice_span(node: fx.Node, size: int) -> tuple[int, int]:
    """(start, end) of a step-1 slice of an axis of `size`, defaults and clamping applied."""
    args = bind_args(node)
    start, end = args.get("start") or 0, args.get("end")
    end = size if end is None else min(end, size)
    return (start + size if start < 0 else start, end + size if end < 0 else end)


def segment_piece(node: fx.Node, s: Sharding) -> Sharding | None:
    """A slice taking whole segments of a fused axis: sharded like one projection."""
    args = bind_args(node)
    rank = len(shape(node.args[0]))
    if norm_axis(args["dim"], rank) != s.axis or args.get("step", 1) != 1:
        return None
    bounds, pos = [], 0
    for n in s.segments:
        bounds.append((pos, pos + n))
        pos += n
    start, end = slice_span(node, pos)
    run = [b for b in bounds if b[0] >= start and b[1] <= end]
    if not run or run[0][0] != start or run[-1][1] != end:
        return None
    segs = tuple(b - a for a, b in run)
    return Sharding("shard", s.axis, s.parts, segs if len(segs) > 1 else None)


def indexed_axes(rank: int, indices) -> list[int | None]:
    """For `dest[indices]` (advanced indexing, None for a full slice): the dest axis of
    each result axis, None where the broadcast index tensors' axes stand."""
    used = [i for i, x in enumerate(indices) if x is not None]
    idx_rank = max(len(x.meta["val"].shape) for x in indices if x is not None)
    rest = [a for a in range(rank) if a not in used]
    if used == list(range(used[0], used[-1] + 1)):  # adjacent: the index dims stay in place
        before = [a for a in rest if a < used[0]]
        return before + [None] * idx_rank + [a for a in rest if a > used[0]]
    return [None] * idx_rank + rest


class Rules:
    """The rules, reading the current shardings through `get(node)` (None: a weight or
    buffer not yet cut, which takes whatever its first consumer asks for)."""

    def __init__(self, get, tp: int, column_parts):
        self.get = get
        self.tp = tp
        # (node, feature axis) -> (parts, segments) for a projection's output features
        self.column_parts = column_parts

    def decide(self, node: fx.Node) -> Decision:
        name = op_name(node.target)
        ins = tensor_inputs(node)
        partial = [a for a in ins if self.get(a) == PARTIAL]
        if partial and name not in VIEW_TARGETS:
            linear = self.linear_in_partials(node, name, ins)
            if linear is not None:
                return linear
            # all-reduced first: the op's own rule then sees whole values
            get = self.get
            self.get = lambda n: REPLICATE if get(n) == PARTIAL else get(n)
            try:
                d = self.decide(node)
            finally:
                self.get = get
            for a in partial:
                d.wants.setdefault(a, REPLICATE)
            return d
        if name in KILN_OP_RULES:
            return KILN_OP_RULES[name](self, node)
        if name in VIEW_TARGETS:
            return self.view(node, name)
        if name in SPLITS:
            return self.split(node)
        if name == "getitem":
            src = self.get(node.args[0])
            return Decision(src[node.args[1]] if isinstance(src, list) else REPLICATE)
        if name in ("aten.mm.default", "aten.addmm.default"):
            return self.mm(node)
        if name == "aten.bmm.default":
            return self.bmm(node)
        if name == "aten.embedding.default":
            return self.embedding(node)
        if name in SDPA_FORMS:
            return self.attention(node)
        if name in ("aten.index_put.default",):
            return self.index_put(node)
        if name in ("aten.index_copy.default", "aten.slice_scatter.default",
                    "aten.copy.default"):
            return self.same_axes_write(node, name)
        if name == "aten.cat.default":
            return self.cat(node)
        if name in ("aten.index.Tensor", "aten.index_select.default"):
            return self.index(node, name)
        if name == "aten.gather.default":
            return self.gather(node)
        cat = category(name)
        if cat == OpCategory.POINTWISE:
            return self.pointwise(node)
        if cat == OpCategory.REDUCTION:
            return self.reduction(node, name)
        return replicated(node)

    # -- helpers -------------------------------------------------------------------

    def committed(self, node: fx.Node) -> Sharding:
        s = self.get(node)
        return REPLICATE if s is None else s

    def conform(self, node: fx.Node, target: Sharding, out_rank: int) -> Sharding:
        """What an operand broadcast into an output sharded as `target` must be."""
        if not target.is_shard:
            return REPLICATE
        dims = shape(node)
        axis = target.axis - (out_rank - len(dims))
        if axis < 0 or dims[axis] == 1:
            return REPLICATE  # broadcast along the sharded axis: every rank needs all of it
        return Sharding("shard", axis, target.parts, target.segments)

    def linear_in_partials(self, node: fx.Node, name: str,
                           ins: list[fx.Node]) -> Decision | None:
        """Sums of partial sums, and a partial sum scaled or summed, stay partial when
        nothing else reads the partial values: one all-reduce for a MoE's routed and
        shared experts, not two. None: the partial inputs are all-reduced first."""
        if any(self.get(a) == PARTIAL and len(a.users) > 1 for a in ins):
            return None
        have = [self.committed(a) for a in ins]
        if name == "aten.add.Tensor" and all(h == PARTIAL for h in have) and len(ins) == 2 \
                and bind_args(node).get("alpha", 1) == 1 and not node.kwargs:
            return Decision(PARTIAL, {a: PARTIAL for a in ins})
        if name == "aten.sum.dim_IntList" and len(ins) == 1:
            return Decision(PARTIAL, {ins[0]: PARTIAL})
        if name == "aten.mul.Tensor" and have.count(PARTIAL) == 1 and len(ins) == 2 \
                and all(h in (PARTIAL, REPLICATE) for h in have):
            return Decision(PARTIAL, dict(zip(ins, have)))
        return None

    # -- rules ---------------------------------------------------------------------

    def view(self, node: fx.Node, name: str) -> Decision:
        src = node.args[0]
        s = self.get(src)
        if s is None:
            return Decision(None)  # a view of an uncut weight stays uncut
        if s == PARTIAL:
            ok = name in VIEW_TARGETS - {"aten.slice.Tensor", "aten.select.int",
                                         "aten._to_copy.default"}
            return Decision(PARTIAL) if ok else Decision(REPLICATE, {src: REPLICATE})
        if name == "aten.slice.Tensor" and s.is_shard and s.segments:
            piece = segment_piece(node, s)
            if piece is not None:
                return Decision(piece)
        out = map_sharding(node, s)
        if out is None:
            return Decision(REPLICATE, {src: REPLICATE})
        return Decision(out)

    def split(self, node: fx.Node) -> Decision:
        src = node.args[0]
        s = self.committed(src)
        n_out = len(node.meta["val"])
        args = bind_args(node)
        rank = len(shape(src))
        dim = norm_axis(args.get("dim", 0), rank)
        if not s.is_shard or s == PARTIAL:
            return Decision([REPLICATE] * n_out, {src: REPLICATE})
        if s.axis != dim:
            keep = s.axis - (op_name(node.target) == "aten.unbind.int" and s.axis > dim)
            return Decision([Sharding("shard", keep, s.parts, s.segments)] * n_out)
        sizes = [v.shape[dim] for v in node.meta["val"]]
        if s.segments and tuple(sizes) == s.segments:
            return Decision([shard(dim, s.parts)] * n_out)
        return Decision([REPLICATE] * n_out, {src: REPLICATE})

    def mm(self, node: fx.Node) -> Decision:
        a, b = (node.args[1], node.args[2]) if len(node.args) == 3 else node.args[:2]
        sa, sb = self.committed(a), self.get(b)
        if sa.is_shard and sa.axis == 1:  # contraction split: row parallel
            k = shape(a)[1]
            parts = self.tp if not sa.segments and divides(k, shard(1, self.tp)) else 0
            if not parts:
                return Decision(REPLICATE, {a: REPLICATE, b: REPLICATE})
            return Decision(PARTIAL, {a: shard(1, parts), b: shard(0, parts)})
        if sa.is_shard and sa.axis == 0:  # rows split (sequence): weights replicated
            return Decision(sa, {b: REPLICATE})
        if sb is None:
            parts, segs = self.column_parts(node, 1)
            want = shard(1, parts, segs) if parts > 1 else REPLICATE
            return Decision(want, {a: REPLICATE, b: want})
        if sb.is_shard and sb.axis == 1:
            return Decision(sb, {a: REPLICATE})
        if sb.is_shard and sb.axis == 0 and sb.parts == self.tp and not sb.segments:
            return Decision(PARTIAL, {a: shard(1, self.tp)})
        return Decision(REPLICATE, {a: REPLICATE, b: REPLICATE})

    def bmm(self, node: fx.Node) -> Decision:
        a, b = node.args[:2]
        sa = self.committed(a)
        if sa.is_shard and sa.axis == 0 and not sa.segments:
            return Decision(sa, {b: sa})
        if self.get(b) is None:  # a linear over 3-d input: a weight expanded over the batch
            return self.batched_linear(node, a, b)
        sb = self.committed(b)
        if sb.is_shard and sb.axis == 0 and not sb.segments:
            return Decision(sb, {a: sb})
        return replicated(node)

    def batched_linear(self, node: fx.Node, a: fx.Node, b: fx.Node) -> Decision:
        """bmm(x, W^T expanded to the batch): column or row parallel, as mm."""
        sa = self.committed(a)
        if sa.is_shard and sa.axis == 2 and sa.parts == self.tp and not sa.segments \
                and divides(shape(a)[2], sa):
            return Decision(PARTIAL, {a: sa, b: shard(1, self.tp)})
        if sa.is_shard:
            return replicated(node)
        parts, segs = self.column_parts(node, 2)
        want = shard(2, parts, segs) if parts > 1 else REPLICATE
        return Decision(want, {a: REPLICATE, b: want})

    def embedding(self, node: fx.Node) -> Decision:
        weight, ids = node.args[:2]
        s = self.get(weight)
        vocab_cut = shard(0, self.tp)
        if s is None and divides(shape(weight)[0], vocab_cut):
            s = vocab_cut
        if s == vocab_cut:
            return Decision(PARTIAL, {weight: vocab_cut, ids: REPLICATE},
                            rewrite="vocab_parallel_embedding")
        return replicated(node)

    def attention(self, node: fx.Node) -> Decision:
        args = bind_args(node)
        q, k, v, mask = args["query"], args["key"], args["value"], args.get("attn_mask")
        sq = self.committed(q)
        if not (sq.is_shard and sq.axis == len(shape(q)) - 3 and not sq.segments):
            return replicated(node)
        heads = shape(q)[sq.axis]
        if sq.parts != self.tp and self.tp % sq.parts == 0 and heads % self.tp == 0:
            # q arrives cut coarser than its heads allow (a fused wqkv whose k and v
            # have fewer heads than ranks is cut as finely as they are): each rank takes
            # its own heads out of its part, a local slice, no communication
            sq = shard(sq.axis, self.tp)
        if sq.parts != self.tp:
            raise ShapeError(
                f"tensor parallelism over {self.tp} ranks needs the {shape(q)[sq.axis]} "
                f"query heads of this attention to divide among them",
                where=where(node), hint="choose a tp that divides the number of heads")
        head_axis, heads_kv = sq.axis, shape(k)[sq.axis]
        kv_parts = sq.parts
        if args.get("enable_gqa") and heads_kv != shape(q)[head_axis]:
            if heads_kv % sq.parts and sq.parts % heads_kv == 0:
                kv_parts = heads_kv  # fewer KV heads than ranks: each serves several ranks
            elif heads_kv % sq.parts:
                return replicated(node)
        wants = {q: sq, k: shard(head_axis, kv_parts), v: shard(head_axis, kv_parts)}
        if isinstance(mask, fx.Node):
            wants[mask] = self.conform(mask, sq, len(shape(q)))
        return Decision(sq, wants)

    def index_put(self, node: fx.Node) -> Decision:
        dest, indices, values = node.args[:3]
        nd_values = len(shape(values))
        axes = indexed_axes(len(shape(dest)), indices)  # result axis -> dest axis or None
        wants = {i: REPLICATE for i in indices if isinstance(i, fx.Node)}
        sv, sd = self.committed(values), self.get(dest)
        lift = len(axes) - nd_values  # values broadcast into the result from the right
        target = None
        if sd is not None and sd.is_shard:
            target = sd
        elif sv.is_shard and sv.axis + lift >= 0 and axes[sv.axis + lift] is not None:
            target = Sharding("shard", axes[sv.axis + lift], sv.parts, sv.segments)
        if target is None:
            return Decision(REPLICATE, {**wants, dest: REPLICATE, values: REPLICATE})
        vaxis = axes.index(target.axis) - lift
        want_v = (Sharding("shard", vaxis, target.parts, target.segments)
                  if vaxis >= 0 and shape(values)[vaxis] != 1 else REPLICATE)
        return Decision(target, {**wants, dest: target, values: want_v})

    def index(self, node: fx.Node, name: str) -> Decision:
        """Gathering along other axes keeps a cut (a paged KV cache read by block)."""
        src = node.args[0]
        s = self.committed(src)
        rank = len(shape(src))
        if name == "aten.index.Tensor":
            indices = node.args[1]
            axes = indexed_axes(rank, indices)
        else:
            dim = norm_axis(node.args[1], rank)
            indices = [node.args[2]]
            axes = [a if a != dim else None for a in range(rank)]
        wants = {i: REPLICATE for i in indices if isinstance(i, fx.Node)}
        if not s.is_shard or s.axis not in axes:
            return Decision(REPLICATE, {**wants, src: REPLICATE})
        return Decision(Sharding("shard", axes.index(s.axis), s.parts, s.segments),
                        {**wants, src: s})

    def same_axes_write(self, node: fx.Node, name: str) -> Decision:
        dest = node.args[0]
        src = node.args[3] if name == "aten.index_copy.default" else node.args[1]
        dim = None
        if name != "aten.copy.default":
            dim = norm_axis(node.args[1] if name == "aten.index_copy.default"
                            else bind_args(node)["dim"], len(shape(dest)))
        s = self.get(dest) or self.committed(src)
        if not s.is_shard or s.axis == dim or len(shape(src)) != len(shape(dest)):
            return replicated(node)
        wants = {dest: s, src: s}
        if name == "aten.index_copy.default":
            wants[node.args[2]] = REPLICATE
        return Decision(s, wants)

    def cat(self, node: fx.Node) -> Decision:
        parts = node.args[0]
        rank = len(shape(node))
        dim = norm_axis(node.args[1] if len(node.args) > 1 else 0, rank)
        first = next((self.committed(p) for p in parts if self.committed(p).is_shard), None)
        if first is None:
            return replicated(node)
        if first.axis == dim:
            return self.cat_segments(node, parts, dim, first.parts)
        return Decision(first, {p: self.conform(p, first, rank) for p in parts})

    def cat_segments(self, node: fx.Node, parts, dim: int, n: int) -> Decision:
        """Pieces cut along the axis they are joined on: each rank joins its blocks, and
        the result is a fused axis, one segment per piece (a convolution over [q, k, v])."""
        segs, wants = [], {}
        for p in parts:
            s = self.committed(p)
            want = s if s.is_shard and s.axis == dim and s.parts == n else shard(dim, n)
            if not divides(shape(p)[dim], want):
                return replicated(node)
            wants[p] = want
            segs.extend(want.segments or (shape(p)[dim],))
        return Decision(Sharding("shard", dim, n, tuple(segs) if len(segs) > 1 else None),
                        wants)

    def gather(self, node: fx.Node) -> Decision:
        """torch.gather along one axis keeps a cut of another (its index cut alike)."""
        src, dim, index = node.args[:3]
        s = self.committed(src)
        rank = len(shape(src))
        size, along = shape(src)[s.axis] if s.is_shard else None, None
        if s.is_shard and s.axis != norm_axis(dim, rank):
            along = shape(index)[s.axis]
        if not (isinstance(size, int) and isinstance(along, int) and along == size):
            return replicated(node)  # (compared as ints: no guard on a size symbol)
        return Decision(s, {src: s, index: s})

    def pointwise(self, node: fx.Node) -> Decision:
        ins = tensor_inputs(node)
        rank = len(shape(node))
        target = REPLICATE
        for a in ins:
            s = self.get(a)
            if s is not None and s.is_shard:
                lifted = s.axis + rank - len(shape(a))
                target = Sharding("shard", lifted, s.parts, s.segments)
                break
        return Decision(target, {a: self.conform(a, target, rank) for a in ins})

    def reduction(self, node: fx.Node, name: str) -> Decision:
        src = node.args[0]
        s = self.committed(src)
        val = node.meta["val"]
        if not s.is_shard or isinstance(val, (tuple, list)):
            return replicated(node)
        rank = len(shape(src))
        args = bind_args(node)
        dims = reduction_dims(name, node.args, node.kwargs, rank)
        if s.axis in dims and name == "aten.sum.dim_IntList" and s.parts == self.tp \
                and not s.segments:
            return Decision(PARTIAL, {src: s})  # each rank sums its part; all-reduced later
        if s.axis in dims:
            return replicated(node)
        keep = args.get("keepdim", False) or name in ("aten._softmax.default",
                                                      "aten._log_softmax.default")
        axis = s.axis if keep else s.axis - sum(d < s.axis for d in dims)
        return Decision(Sharding("shard", axis, s.parts, s.segments), {src: s})
