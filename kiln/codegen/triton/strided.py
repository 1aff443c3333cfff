"""Operands of templates as strided views of plan values: no copies, just strides.

Every plan value is contiguous and row-major, and most view chains a template's
operands arrive through (permute(W) of a linear layer's weight, view + transpose of
a projection into heads, a K/V cache slice, a mask broadcast to [B, H, T, S]) keep
element (i0, ..., ik) at `offset + sum(i_d * stride_d)` of the underlying value.
`resolve` walks a region's view ops back to the value and returns that map, or None
when the chain is not strided (a reshape that merges non-contiguous dims, ...); a
template then reads the operand some other way or declines the region.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from kiln.ir.plan import Op, Ref, Region, Sym
from kiln.ir.reshape import groups
from kiln.ir.symbolic import Dim, as_dim

# Ops that leave every value unchanged in kiln's value semantics.
_TRANSPARENT = {"aten.alias.default", "aten.clone.default", "aten.detach.default",
                "aten.lift_fresh_copy.default"}


@dataclass(frozen=True)
class Strided:
    """Element (i0, ..., ik) of this operand is `value[offset + sum(i_d * strides[d])]`."""

    value: str  # plan value (flat, row-major storage)
    shape: tuple[Dim, ...]
    strides: tuple[Dim, ...]
    offset: Dim = 0

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_rank(self, rank: int) -> Strided:
        """Left-pad with broadcast dims (size 1, stride 0), as torch broadcasting does."""
        pad = rank - self.rank
        if pad < 0:
            raise ValueError(f"cannot view rank {self.rank} as rank {rank}")
        return Strided(self.value, (1,) * pad + self.shape, (0,) * pad + self.strides,
                       self.offset)

    def is_contiguous_last(self) -> bool:
        return self.rank > 0 and _eq(self.strides[-1], 1)


def row_major(shape) -> tuple[Dim, ...]:
    strides: list[Dim] = []
    acc: Dim = 1
    for d in reversed(shape):
        strides.append(acc)
        acc = _simp(acc * d)
    return tuple(reversed(strides))


def _simp(x) -> Dim:
    return as_dim(sympy.expand(x)) if isinstance(x, sympy.Expr) else x


def _eq(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def _int(a) -> Dim:
    if isinstance(a, Sym):
        return a.expr
    return a


def resolve(region: Region, ref, values: dict) -> Strided | None:
    """The strided map of `ref` (a Ref to a region input or op) inside `region`."""
    if not isinstance(ref, Ref):
        return None
    if ref.name in region.inputs:
        v = values[ref.name]
        return Strided(ref.name, tuple(v.shape), row_major(v.shape))
    try:
        op = region.op(ref.name)
    except KeyError:
        return None
    return _through(region, op, values)


def _through(region: Region, op: Op, values: dict) -> Strided | None:
    name = op.target
    if name == "getitem":
        return _getitem(region, op, values)
    if name in _TRANSPARENT:
        return resolve(region, op.args[0], values)
    src = resolve(region, op.args[0], values) if op.args else None
    if src is None:
        return None
    shape = tuple(op.shape) if op.shape is not None else None
    if name in ("aten.permute.default",):
        dims = [d % src.rank for d in op.args[1]]
        return Strided(src.value, shape, tuple(src.strides[d] for d in dims), src.offset)
    if name == "aten.transpose.int":
        a, b = op.args[1] % src.rank, op.args[2] % src.rank
        st = list(src.strides)
        st[a], st[b] = st[b], st[a]
        return Strided(src.value, shape, tuple(st), src.offset)
    if name == "aten.t.default":
        return Strided(src.value, shape, tuple(reversed(src.strides)), src.offset)
    if name in ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"):
        return _reshape(src, shape)
    if name == "aten.expand.default":
        return _expand(src, shape)
    if name == "aten.unsqueeze.default":
        d = op.args[1] % (src.rank + 1)
        st = list(src.strides)
        st.insert(d, 0)
        return Strided(src.value, shape, tuple(st), src.offset)
    if name in ("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default"):
        return _squeeze(src, op, shape)
    if name == "aten.slice.Tensor":
        dim = (op.args[1] if len(op.args) > 1 else 0) % src.rank
        start = _int(op.args[2]) if len(op.args) > 2 and op.args[2] is not None else 0
        step = op.args[4] if len(op.args) > 4 else 1
        return _slice(src, dim, start, step, shape)
    if name == "aten.select.int":
        dim, index = op.args[1] % src.rank, _int(op.args[2])
        return _select(src, dim, index)
    return None


def _getitem(region: Region, op: Op, values: dict) -> Strided | None:
    parent = region.op(op.args[0].name)
    k = op.args[1]
    src = resolve(region, parent.args[0], values)
    if src is None:
        return None
    if parent.target in ("aten.split_with_sizes.default", "aten.split.Tensor"):
        dim = (parent.args[2] if len(parent.args) > 2 else 0) % src.rank
        if parent.target == "aten.split_with_sizes.default":
            start = sum(_int(s) for s in parent.args[1][:k])
        else:
            start = _int(parent.args[1]) * k
        return _slice(src, dim, start, 1, tuple(op.shape))
    if parent.target == "aten.unbind.int":
        dim = (parent.args[1] if len(parent.args) > 1 else 0) % src.rank
        return _select(src, dim, k)
    return None


def _slice(src: Strided, dim: int, start, step: int, shape) -> Strided:
    if isinstance(start, int) and start < 0:
        start = _simp(src.shape[dim] + start)
    st = list(src.strides)
    offset = _simp(src.offset + start * src.strides[dim])
    st[dim] = _simp(src.strides[dim] * step)
    return Strided(src.value, shape, tuple(st), offset)


def _select(src: Strided, dim: int, index) -> Strided:
    if isinstance(index, int) and index < 0:
        index = _simp(src.shape[dim] + index)
    offset = _simp(src.offset + index * src.strides[dim])
    shape = src.shape[:dim] + src.shape[dim + 1:]
    strides = src.strides[:dim] + src.strides[dim + 1:]
    return Strided(src.value, shape, strides, offset)


def _expand(src: Strided, shape) -> Strided:
    pad = len(shape) - src.rank
    src = src.with_rank(len(shape))
    st = []
    for d, (old, new) in enumerate(zip(src.shape, shape)):
        st.append(0 if d < pad or (_eq(old, 1) and not _eq(new, 1)) else src.strides[d])
    return Strided(src.value, shape, tuple(st), src.offset)


def _squeeze(src: Strided, op: Op, shape) -> Strided | None:
    if op.target == "aten.squeeze.default":
        dims = [d for d, s in enumerate(src.shape) if _eq(s, 1)]
    else:
        arg = op.args[1]
        dims = [d % src.rank for d in (arg if isinstance(arg, (list, tuple)) else [arg])]
        dims = [d for d in dims if _eq(src.shape[d], 1)]
    keep = [d for d in range(src.rank) if d not in dims]
    if len(keep) != len(shape):
        return None
    return Strided(src.value, shape, tuple(src.strides[d] for d in keep), src.offset)


def _reshape(src: Strided, shape) -> Strided | None:
    """A reshape is strided when each group of merged dims is contiguous in itself."""
    pairs = groups(src.shape, shape)
    if pairs is None:
        return None
    strides: list[Dim] = [0] * len(shape)
    for gi, gj in pairs:
        live = [d for d in gi if not _eq(src.shape[d], 1)]
        for a, b in zip(live, live[1:]):
            if not _eq(src.strides[a], src.strides[b] * src.shape[b]):
                return None
        inner = src.strides[live[-1]] if live else 0
        acc: Dim = inner
        for j in reversed(gj):
            strides[j] = acc
            acc = _simp(acc * shape[j])
    return Strided(src.value, tuple(shape), tuple(strides), src.offset)
