"""An RMSNorm read as a row scale: the structure a matmul's prologue needs to fold it.

y = (x * rsqrt(mean(x^2, -1) + eps)) * w, with casts anywhere along the way, is per
row a scale times an elementwise product, y[m, k] = r[m] * x[m, k] * w[k], so a
matmul reading y is r[m] * ((x * w) @ W)[m, n]: the product of the unscaled rows,
scaled per row after the reduction over K. `fold_rmsnorm` moves such a norm into the
matmuls that read it; the matmul template's GEMV form computes it that way.

Recognised on a region's ops (plan Ops), from the normalised value down: casts and
multiplications by factors that do not depend on the norm (the weight, Gemma's 1 + w,
a scalar), exactly one of them by the row scale, which is rsqrt(v), 1 / sqrt(v) or a
division by sqrt(v), v = mean(x^2 or x * x over the last dim, keepdim) plus an
optional scalar eps. Anything else (a mean over another dim, an add in the chain, a
LayerNorm's centred x, a tensor eps) is not a row scale and is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.ir.ops import IDENTITY_OPS, SHAPE_ONLY_OPS, OpCategory, bind_args, category, norm_axis
from kiln.ir.plan import Op, Ref
from kiln.ir.symbolic import Dim, same_dim

CAST = "aten._to_copy.default"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_CAST_KWARGS = {"dtype", "memory_format", "layout", "device", "non_blocking"}  # see is_cast


@dataclass(frozen=True)
class RowNorm:
    out: str  # the normalised value y
    x: str  # the value whose rows are normalised (as the scale's multiply reads it)
    chain: tuple[str, ...]  # ops from `out` down to the scale's, top first
    scale: str  # the op applying the row scale: x * rsqrt(v), x * (1 / sqrt(v)), x / sqrt(v)
    mean: str  # mean(x^2) over the last dim
    eps: float
    dim: Dim  # the normalised (last) dim's size

    def factors(self, ops: dict[str, Op]) -> list[tuple[Op, object]]:
        """(multiply, its other operand) for every factor besides the row scale, bottom
        first: the product x * factors is what the matmul multiplies before scaling."""
        out = []
        for name in reversed(self.chain):
            op = ops[name]
            if op.target != "aten.mul.Tensor" or name == self.scale:
                continue
            a, b = op.args[:2]
            below = self.chain[self.chain.index(name) + 1]
            out.append((op, b if isinstance(a, Ref) and a.name == below else a))
        return out


def match_row_norm(ops: dict[str, Op], out: str) -> RowNorm | None:
    """The RMSNorm whose result is op `out` of `ops` (a region's, by name), or None."""
    top = ops.get(out)
    if top is None or not top.shape or top.dtype not in _FLOATS:
        return None
    chain: list[str] = []
    name = out
    while True:
        op = ops.get(name)
        if op is None or op.shape is None or not same_shape(op.shape, top.shape):
            return None
        chain.append(name)
        if is_cast(op):
            name = op.args[0].name
            continue
        a, b = (op.args + (None, None))[:2]
        if op.target == "aten.div.Tensor":
            v = _sqrt_arg(ops, b)
            return _finish(ops, chain, a, v, top)
        if op.target != "aten.mul.Tensor":
            return None
        for x, r in ((a, b), (b, a)):
            v = _rsqrt_arg(ops, r)
            if v is not None:
                return _finish(ops, chain, x, v, top)
        normed = [arg for arg in (a, b) if isinstance(arg, Ref) and _reduces(ops, arg.name)]
        if len(normed) != 1:  # the scale on exactly one side; the other a factor
            return None
        name = normed[0].name


def _finish(ops, chain, x, v, top: Op) -> RowNorm | None:
    """The norm whose scale's multiply (chain[-1]) reads `x` and the variance `v`."""
    if not isinstance(x, Ref) or v is None or _reduces(ops, x.name):
        return None
    mean, eps = _variance(ops, v)
    if mean is None or not same_shape(ops[v.name].shape, top.shape[:-1] + (1,)):
        return None
    squared = _squared(ops, ops[mean].args[0])
    if squared is None or _root(ops, squared) != _root(ops, x.name):
        return None
    if not same_shape(ops[ops[mean].args[0].name].shape, top.shape):
        return None  # x (the square's root) has y's shape: one scale per row of y
    return RowNorm(top.name, x.name, tuple(chain), chain[-1], mean, eps, top.shape[-1])


def _rsqrt_arg(ops, r) -> Ref | None:
    """v when `r` is rsqrt(v) or 1 / sqrt(v)."""
    op = _op(ops, r)
    if op is None:
        return None
    if op.target == "aten.rsqrt.default":
        return op.args[0]
    if op.target == "aten.reciprocal.default":
        return _sqrt_arg(ops, op.args[0])
    return None


def _sqrt_arg(ops, s) -> Ref | None:
    op = _op(ops, s)
    return op.args[0] if op is not None and op.target == "aten.sqrt.default" else None


def _variance(ops, v) -> tuple[str | None, float]:
    """(mean op, eps) when `v` is mean(x^2 over the last dim, keepdim) [+ scalar eps]."""
    op = _op(ops, v)
    eps = 0.0
    if op is not None and op.target in ("aten.add.Tensor", "aten.add.Scalar"):
        a, b = op.args[:2]
        mean, eps = (a, b) if isinstance(b, (int, float)) else (b, a)
        alpha = op.kwargs.get("alpha", 1)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or alpha != 1:
            return None, 0.0
        op = _op(ops, mean)
    if op is None or op.target != "aten.mean.dim":
        return None, 0.0
    a = bind_args(op)
    src = _op(ops, a["self"])
    dims = a["dim"] if isinstance(a["dim"], (list, tuple)) else [a["dim"]]
    if (src is None or not src.shape or not a["keepdim"] or len(dims) != 1
            or not isinstance(dims[0], int)):
        return None, 0.0
    if norm_axis(dims[0], len(src.shape)) != len(src.shape) - 1:
        return None, 0.0
    return op.name, float(eps)


def _squared(ops, s) -> str | None:
    """x when `s` is x ** 2 or x * x."""
    op = _op(ops, s)
    if op is None:
        return None
    pow2 = op.target == "aten.pow.Tensor_Scalar" and op.args[1] == 2
    if not (pow2 or (op.target == "aten.mul.Tensor" and op.args[0] == op.args[1])):
        return None
    x = op.args[0]
    return x.name if isinstance(x, Ref) else None


def _root(ops, name: str) -> str:
    """`name` with the casts above it stripped: x and x.float() are one value."""
    while name in ops and is_cast(ops[name]):
        name = ops[name].args[0].name
    return name


def _reduces(ops, name: str) -> bool:
    """Does value `name` depend on a reduction among `ops`?"""
    stack, seen = [name], set()
    while stack:
        n = stack.pop()
        if n in seen or n not in ops:
            continue
        seen.add(n)
        if category(ops[n].target) == OpCategory.REDUCTION:
            return True
        stack.extend(ops[n].refs())
    return False


def is_cast(op: Op) -> bool:
    """A dtype change and nothing else: `x.float()`, `.to(dtype)`, and `type_as(x)` /
    `.to(x.dtype)` with the layout and device torch records beside (strided; a region
    runs on one device, so its device is the tensor's own: transformers' Gemma RMSNorm
    ends so in bf16 and was not folded)."""
    kw = op.kwargs
    return (op.target == CAST and op.dtype in _FLOATS and set(kw) <= _CAST_KWARGS
            and kw.get("layout", torch.strided) == torch.strided
            and not kw.get("non_blocking", False) and isinstance(op.args[0], Ref))


def _op(ops, arg) -> Op | None:
    return ops.get(arg.name) if isinstance(arg, Ref) else None


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def closure(ops: dict[str, Op], name: str) -> set[str]:
    """The ops among `ops` that value `name` is computed from, itself included."""
    stack, seen = [name], set()
    while stack:
        n = stack.pop()
        if n in seen or n not in ops:
            continue
        seen.add(n)
        stack.extend(ops[n].refs())
    return seen


def operand_path(ops: dict[str, Op], anchor: Op, arg: int, source: str) -> list[str] | None:
    """The reshapes between `source` and argument `arg` of `anchor` (anchor side first),
    or None when that argument is not `source` seen through reshapes only."""
    a = anchor.args[arg] if arg < len(anchor.args) else None
    path: list[str] = []
    while isinstance(a, Ref) and a.name != source:
        op = ops.get(a.name)
        if op is None or op.target not in SHAPE_ONLY_OPS | IDENTITY_OPS:
            return None
        path.append(a.name)
        a = op.args[0]
    return path if isinstance(a, Ref) else None


def read_only_as_operand(region_ops: list[Op], outputs: list[str], anchor: Op, arg: int,
                         source: str, inside: set[str] = frozenset(),
                         siblings: tuple[tuple[Op, int], ...] = ()) -> bool:
    """Is `source` (and each op of `inside`, what it is computed from in the region)
    read by nothing but argument `arg` of `anchor` (or of a sibling product grouped
    with it, `siblings`: (product, argument) pairs), through reshapes? The row scale
    applies to the product, so any other reader would see the unscaled rows."""
    ops = {o.name: o for o in region_ops}
    reading = {anchor.name: (anchor, arg), **{op.name: (op, a) for op, a in siblings}}
    paths = [operand_path(ops, op, a, source) for op, a in reading.values()]
    if any(path is None for path in paths):
        return False
    on_path = {n for path in paths for n in path}
    owned = set(inside) | {source} | on_path
    for op in region_ops:
        if op.name in inside:
            continue  # the norm's own ops read each other
        reads = set(op.refs()) & owned
        if op.name in reading:
            a = reading[op.name][1]
            if [x for x in op.args if isinstance(x, Ref) and x.name in owned] != [op.args[a]]:
                return False
            if any(isinstance(v, Ref) and v.name in owned for v in op.kwargs.values()):
                return False
        elif reads != ({op.args[0].name} if op.name in on_path else set()):
            return False
    return not (owned & set(outputs))
