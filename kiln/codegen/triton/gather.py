"""Indirect and selecting reads: gathers load through loaded indices, concatenations and
pads pick, per element, which input (or the pad value) to read.

- embedding / index.Tensor (None and tensor indices, numpy advanced-indexing rules) /
  index_select / gather: the index tensor is read at the element's position and the
  source at the resulting index; negative indices wrap where torch wraps them.
- cat / constant_pad_nd: each piece is read under its own condition (masked, so no
  lane reads outside a piece) and `tl.where` selects; nothing is padded in memory.
"""

from __future__ import annotations

import torch

from kiln.codegen.triton.emit import Cond, Emitter, Val, literal
from kiln.codegen.triton.indexing import Index, Lin, broadcast_index, norm, same
from kiln.codegen.triton.views import CodegenUnsupported, dim_value
from kiln.ir.plan import Op, Ref


def _axis(d: int, rank: int) -> int:
    return d % rank if rank else 0


def _index_value(em: Emitter, ref: Ref, index: Index, mask, size, wrap: bool) -> Lin:
    """The integer read from index tensor `ref` at `index`, as an index into `size`."""
    v = em.value(ref.name, index, mask)
    if v.dtype == torch.bool or v.dtype.is_floating_point:
        raise CodegenUnsupported(f"indexing with a {v.dtype} tensor")
    if wrap:
        v = em.let(f"tl.where({v} < 0, {v} + {em.dim(size)}, {v})", v.dtype, v.vars)
    return em.opaque(v, size)


def emit_gather(em: Emitter, op: Op, index: Index, mask) -> Val:
    t = op.target
    a = op.args
    src = a[0].name
    sshape = em.shape(src)
    if t == "aten.embedding.default":
        ids = a[1]
        lead = len(em.shape(ids.name))
        row = _index_value(em, ids, index[:lead], mask, sshape[0], wrap=False)
        return em.value(src, (row,) + tuple(index[lead:]), mask)
    if t == "aten.index_select.default":
        d = _axis(a[1], len(sshape))
        i = _index_value(em, a[2], (index[d],), mask, sshape[d], wrap=False)
        return em.value(src, index[:d] + (i,) + index[d + 1:], mask)
    if t == "aten.gather.default":
        d = _axis(a[1], len(sshape))
        i = _index_value(em, a[2], index, mask, sshape[d], wrap=True)
        return em.value(src, index[:d] + (i,) + index[d + 1:], mask)
    if t == "aten.index.Tensor":
        return em.value(src, _advanced_index(em, op, index, mask), mask)
    raise CodegenUnsupported(f"{t} is not generated")


def _advanced_index(em: Emitter, op: Op, index: Index, mask) -> Index:
    """Source index of output element `index` of x[indices] (numpy advanced indexing)."""
    src = op.args[0].name
    sshape = em.shape(src)
    indices = list(op.args[1]) + [None] * (len(sshape) - len(op.args[1]))
    where = [k for k, t in enumerate(indices) if t is not None]
    if not where:
        return index
    shapes = [em.shape(indices[k].name) for k in where]
    rank_b = max(len(s) for s in shapes)
    adjacent = where == list(range(where[0], where[-1] + 1))
    if adjacent:
        b_start = where[0]
    else:
        b_start = 0
    b_shape = tuple(op.shape[b_start:b_start + rank_b])
    b_index = index[b_start:b_start + rank_b]
    rest = list(index[:b_start]) + list(index[b_start + rank_b:])
    out: list[Lin] = []
    for k, t in enumerate(indices):
        if t is None:
            out.append(rest.pop(0))
            continue
        sub = broadcast_index(b_index, b_shape, em.shape(t.name))
        out.append(_index_value(em, t, sub, mask, sshape[k], wrap=True))
    return tuple(out)


def emit_concat(em: Emitter, op: Op, index: Index, mask) -> Val:
    if op.target == "aten.cat.default":
        return _cat(em, op, index, mask)
    if op.target == "aten.constant_pad_nd.default":
        return _pad(em, op, index, mask)
    raise CodegenUnsupported(f"{op.target} is not generated")


def _between(em: Emitter, i: Lin, lo, hi) -> list[Cond]:
    """Conditions lo <= i < hi, skipping the ones that hold on every kept lane."""
    conds = []
    if not (isinstance(lo, int) and lo == 0 and i.nonneg()):
        conds.append(Cond(f"{em.code(i)} >= {em.dim(lo)}", i.var_names()))
    if hi is not None and not i.below(hi):
        conds.append(Cond(f"{em.code(i)} < {em.dim(hi)}", i.var_names()))
    return conds


def _select(em: Emitter, dtype: torch.dtype, pieces: list[tuple[list[Cond], Val]],
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


def _cat(em: Emitter, op: Op, index: Index, mask) -> Val:
    d = _axis(op.args[1] if len(op.args) > 1 else op.kwargs.get("dim", 0), len(op.shape))
    # torch.cat skips legacy empty 1-D pieces next to higher-rank ones
    parts = [p for p in op.args[0]
             if not (len(em.shape(p.name)) == 1 < len(op.shape) and same(em.shape(p.name)[0], 0))]
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


def _pad(em: Emitter, op: Op, index: Index, mask) -> Val:
    src = op.args[0].name
    pad = [dim_value(p) for p in op.args[1]]
    value = op.args[2] if len(op.args) > 2 else op.kwargs.get("value", 0)
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
