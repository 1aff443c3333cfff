"""Indirect and selecting reads: gathers load through loaded indices, concatenations and
pads pick, per element, which input (or the pad value) to read.

- embedding / index.Tensor (None and tensor indices, numpy advanced-indexing rules) /
  index_select / gather: the index tensor is read at the element's position and the
  source at the resulting index; negative indices wrap (where torch wraps them, and
  in gather / scatter / index_copy / index_add, where torch refuses them). On the
  interpret target a loaded index that eager PyTorch would refuse fails a device
  assert (`OpEmitter.check_index`) before any read or write through it; so do the
  scatters' (templates/copy.py), which compute their destinations here too. Every
  target then clamps the index into its dim (`kept_in`): on a GPU an index out of
  range reads or writes an element of its own tensor, never memory past it.
- cat / constant_pad_nd: each piece is read under its own condition (masked, so no
  lane reads outside a piece) and `tl.where` selects; nothing is padded in memory.
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.indexing import (
    Index,
    Lin,
    broadcast_index,
    floordiv,
    known_nonneg,
    norm,
)
from kiln.codegen.expr.values import CodegenUnsupported, Cond, OpEmitter, Val, literal
from kiln.codegen.expr.views import dim_value, is_view, select_index, slice_bounds, source_index
from kiln.ir.ops import ARANGES, SLICE_SCATTERS, arange_start_step, bind_args, norm_axis
from kiln.ir.plan import Op, Ref
from kiln.ir.symbolic import same_dim

# the ops whose negative indices torch wraps (advanced indexing); gather, scatter,
# index_copy and index_add refuse them (kiln's code wraps them all the same)
TORCH_WRAPS = frozenset({"aten.index.Tensor", "aten.index_put.default"})


def _index_value(em: OpEmitter, ref: Ref, index: Index, mask, size, wrap: bool,
                 what: str) -> Lin:
    """The integer read from index tensor `ref` at `index`, as an index into `size`, for
    op `what` (checked to lie in the dim on the interpret target)."""
    ramp = _arange_index(em, ref, index)
    if ramp is not None:
        return ramp
    v = em.value(ref.name, index, mask)
    if v.dtype == torch.bool or v.dtype.is_floating_point:
        raise CodegenUnsupported(f"indexing with a {v.dtype} tensor")
    em.check_index(v, size, mask, what, wraps=what in TORCH_WRAPS)
    if wrap:
        v = em.let(f"tl.where({v} < 0, {v} + {em.dim(size)}, {v})", v.dtype, v.vars)
    return em.opaque(em.kept_in(v, size), size)


def _arange_index(em: OpEmitter, ref: Ref, index: Index) -> Lin | None:
    """An index tensor the region computes as an integer arange (through views), read at
    `index`: start + i * step, an affine index rather than a loaded one. A state write
    `cache[torch.arange(B)] = x` then stores at the row its element comes from, as a
    read of that row does (so a kernel can tell it reads and writes the same element)."""
    ops = getattr(em, "ops", {})
    name, idx = ref.name, tuple(index)
    while name in ops and is_view(ops[name], ops):
        name, idx = source_index(ops[name], idx, em.shape, ops)
    op = ops.get(name)
    if op is None or op.target not in ARANGES or op.dtype.is_floating_point:
        return None
    start, step = arange_start_step(op)
    if any(isinstance(x, float) for x in (start, step)):
        return None
    start, step = dim_value(start), dim_value(step)
    if not (isinstance(step, int) and step > 0 and known_nonneg(start)):
        return None  # a ramp that may go negative wraps: loaded as any index is
    return Lin.of(start) + idx[0] * step


def emit_gather(em: OpEmitter, op: Op, index: Index, mask) -> Val:
    t = op.target
    a = op.args
    src = a[0].name
    sshape = em.shape(src)
    if t == "aten.embedding.default":
        ids = a[1]
        lead = len(em.shape(ids.name))
        row = _index_value(em, ids, index[:lead], mask, sshape[0], wrap=False, what=t)
        return em.value(src, (row,) + tuple(index[lead:]), mask)
    if t == "aten.index_select.default":
        d = norm_axis(a[1], len(sshape))
        i = _index_value(em, a[2], (index[d],), mask, sshape[d], wrap=False, what=t)
        return em.value(src, index[:d] + (i,) + index[d + 1:], mask)
    if t == "aten.gather.default":
        d = norm_axis(a[1], len(sshape))
        i = _index_value(em, a[2], index, mask, sshape[d], wrap=True, what=t)
        return em.value(src, index[:d] + (i,) + index[d + 1:], mask)
    if t == "aten.index.Tensor":
        dest = advanced_index(em, sshape, op.args[1], op.shape, index, mask, what=t)
        return em.value(src, dest, mask)
    raise CodegenUnsupported(f"{t} is not generated")


def advanced_index(em: OpEmitter, src_shape, indices, out_shape, index: Index, mask,
                   what: str) -> Index:
    """Index into x of element `index` of x[indices] (numpy advanced indexing) for op
    `what`: the tensor indices broadcast together; their dims replace the indexed dims
    in place when those are adjacent, else they come first."""
    indices = list(indices) + [None] * (len(src_shape) - len(indices))
    where = [k for k, t in enumerate(indices) if t is not None]
    if not where:
        return index
    if any(not isinstance(indices[k], Ref) for k in where):
        raise CodegenUnsupported("advanced indexing with a non-tensor index")
    rank_b = max(len(em.shape(indices[k].name)) for k in where)
    b_start = where[0] if where == list(range(where[0], where[-1] + 1)) else 0
    b_shape = tuple(out_shape[b_start:b_start + rank_b])
    b_index = index[b_start:b_start + rank_b]
    rest = list(index[:b_start]) + list(index[b_start + rank_b:])
    out: list[Lin] = []
    for k, t in enumerate(indices):
        if t is None:
            out.append(rest.pop(0))
            continue
        sub = broadcast_index(b_index, b_shape, em.shape(t.name))
        out.append(_index_value(em, t, sub, mask, src_shape[k], wrap=True, what=what))
    return tuple(out)


def indexed_shape(em: OpEmitter, src_shape, indices) -> tuple:
    """The shape of x[indices] (numpy advanced indexing rules)."""
    indices = list(indices) + [None] * (len(src_shape) - len(indices))
    where = [k for k, t in enumerate(indices) if t is not None]
    b = _broadcast([em.shape(indices[k].name) for k in where]) if where else ()
    if where and where == list(range(where[0], where[-1] + 1)):
        return tuple(src_shape[:where[0]]) + b + tuple(src_shape[where[-1] + 1:])
    return b + tuple(src_shape[k] for k, t in enumerate(indices) if t is None)


def _broadcast(shapes) -> tuple:
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = [s[len(s) - rank + k] for s in shapes if len(s) - rank + k >= 0]
        non_unit = [d for d in dims if not same_dim(d, 1)]
        out.append(non_unit[0] if non_unit else 1)
    return tuple(out)


def emit_concat(em: OpEmitter, op: Op, index: Index, mask) -> Val:
    if op.target == "aten.cat.default":
        return _cat(em, op, index, mask)
    if op.target == "aten.constant_pad_nd.default":
        return _pad(em, op, index, mask)
    raise CodegenUnsupported(f"{op.target} is not generated")


def _between(em: OpEmitter, i: Lin, lo, hi) -> list[Cond]:
    """Conditions lo <= i < hi, skipping the ones that hold on every kept lane."""
    conds = []
    if not (isinstance(lo, int) and lo == 0 and i.nonneg()):
        conds.append(Cond(f"{em.code(i)} >= {em.dim(lo)}", i.var_names()))
    if hi is not None and not i.below(hi):
        conds.append(Cond(f"{em.code(i)} < {em.dim(hi)}", i.var_names()))
    return conds


def _select(em: OpEmitter, dtype: torch.dtype, pieces: list[tuple[list[Cond], Val]],
            default: Val) -> Val:
    """tl.where chain: the first piece whose conditions hold, else `default`."""
    out = default
    for conds, v in reversed(pieces):
        if not conds:
            out = v
            continue
        c = " & ".join(f"({x.code})" for x in conds)
        out = em.let(f"tl.where({c}, {v}, {out})", dtype,
                     frozenset().union(v.vars, out.vars, *(x.vars for x in conds)))
    return out


def _cat(em: OpEmitter, op: Op, index: Index, mask) -> Val:
    a = bind_args(op)
    d = norm_axis(a["dim"], len(op.shape))
    # torch.cat skips legacy empty 1-D pieces next to higher-rank ones
    parts = [p for p in a["tensors"] if not (len(em.shape(p.name)) == 1 < len(op.shape)
                                             and same_dim(em.shape(p.name)[0], 0))]
    if not parts:
        raise CodegenUnsupported("cat of nothing")
    i = index[d]
    pieces = []
    start = 0
    for k, p in enumerate(parts):
        end = norm(start + em.shape(p.name)[d])
        last = k == len(parts) - 1
        conds = _between(em, i, start, None if last else end)  # where this piece is read
        sub = index[:d] + (i - start,) + index[d + 1:]
        v = em.cast(em.value(p.name, sub, frozenset(mask or ()) | frozenset(conds)), op.dtype)
        # pieces are tried in order, so "i < end" alone selects piece k
        sel = [] if last else [Cond(f"{em.code(i)} < {em.dim(end)}", i.var_names())]
        pieces.append((sel, v))
        start = end
    return _select(em, op.dtype, pieces[:-1], pieces[-1][1])


def _pad(em: OpEmitter, op: Op, index: Index, mask) -> Val:
    a = bind_args(op)
    src = a["self"].name
    pad = [dim_value(p) for p in a["pad"]]
    value = a["value"]
    sshape = em.shape(src)
    rank = len(sshape)
    sidx = list(index)
    conds: list[Cond] = []
    for j in range(len(pad) // 2):
        d = rank - 1 - j
        left = pad[2 * j]
        sidx[d] = index[d] - left
        conds += _between(em, sidx[d], 0, sshape[d])
    v = em.cast(em.value(src, tuple(sidx), frozenset(mask or ()) | frozenset(conds)), op.dtype)
    fill = literal(value if value is not None else 0, op.dtype)
    return _select(em, op.dtype, [(conds, v)], fill)


def emit_scatter_select(em: OpEmitter, op: Op, index: Index, mask) -> Val:
    """A functional slice_scatter / select_scatter, per element of the result: the
    source where the element lies in the written slice, the destination elsewhere."""
    if op.target not in SLICE_SCATTERS:
        raise CodegenUnsupported(f"{op.target} is not generated per element")
    a = bind_args(op)
    dest, src = a["self"].name, a["src"].name
    shape = em.shape(dest)
    d = norm_axis(a["dim"], len(shape))
    if op.target == "aten.select_scatter.default":
        k = select_index(a["index"], shape[d])
        conds = [Cond(f"{em.code(index[d])} == {em.dim(k)}", index[d].var_names())]
        sub = index[:d] + index[d + 1:]
    else:
        start, end, step = slice_bounds(a, shape[d], em.shape(src)[d])
        rel = index[d] - start
        conds = _between(em, index[d], start, end)
        if not (isinstance(step, int) and step == 1):
            conds.append(Cond(f"({em.code(rel)}) % {em.dim(step)} == 0", rel.var_names()))
        sub = index[:d] + (floordiv(rel, step),) + index[d + 1:]
    base = frozenset(mask or ())
    v = em.cast(em.value(src, sub, base | frozenset(conds)), op.dtype)
    old = em.cast(em.value(dest, index, base), op.dtype)
    return _select(em, op.dtype, [(conds, v)], old)
