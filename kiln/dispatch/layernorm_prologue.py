"""A LayerNorm read as row statistics: the structure a GEMV's prologue needs to fold it.

y = (x - mu) * r * w + b per row (mu the row's mean, r = rsqrt(var + eps)). Unlike an
RMSNorm (kiln.dispatch.rmsnorm_prologue), whose row scale can wait until after the
product, the centring cannot: (x - mu) @ W needs mu * (w @ W) per column, a second
product over the whole weight tile. Tried so (x, x^2, w and b summed against W in the
K loop, H200): GPT-2-medium's MLP GEMV took 15.9 us against 7.7 + 1.7 for the GEMV and
the norm apart. So the matmul template's GEMV form takes each row's mean and rstd
first, from its x loaded whole (x is a few KB; one vector load a row, hence
LAYER_NORM_MAX_K), and normalises x as it streams the weight.

Recognised on a region's ops: getitem 0 of aten.native_layer_norm over the last dim
(the form torch.export leaves for nn.LayerNorm and F.layer_norm), with casts after it;
weight and bias optional (elementwise_affine=False, bias=False).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from kiln.dispatch.rmsnorm_prologue import CAST, is_cast, same_shape
from kiln.ir.ops import bind_args
from kiln.ir.plan import Op, Ref, Sym
from kiln.ir.symbolic import Dim, same_dim

LAYER_NORM = "aten.native_layer_norm.default"
# the widest row a folded LayerNorm's GEMV loads whole (fp32: 64 values a thread at 4
# warps); wider norms stay kernels of their own
LAYER_NORM_MAX_K = 8192
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LayerNormRows:
    out: str  # the normalised value the matmul reads (getitem 0, or a cast of it)
    x: str  # the value whose rows are normalised
    op: str  # the native_layer_norm op: the region's reduction
    weight: str | None  # region values of shape [dim], or None (1 and 0)
    bias: str | None
    eps: float
    dim: Dim  # the normalised (last) dim's size


def match_layer_norm(ops: dict[str, Op], out: str) -> LayerNormRows | None:
    """The LayerNorm whose result is op `out` of `ops` (a region's, by name), or None."""
    top = ops.get(out)
    if top is None or not top.shape or top.dtype not in _FLOATS:
        return None
    name = out
    while ops.get(name) is not None and ops[name].target == CAST:
        if not is_cast(ops[name]) or not same_shape(ops[name].shape, top.shape):
            return None
        name = ops[name].args[0].name
    item = ops.get(name)
    if item is None or item.target != "getitem" or item.args[1] != 0:
        return None
    ln = ops.get(item.args[0].name) if isinstance(item.args[0], Ref) else None
    if ln is None or ln.target != LAYER_NORM:
        return None
    a = bind_args(ln)
    x, shape = a["input"], a["normalized_shape"]
    if not isinstance(x, Ref) or len(shape) != 1 or not same_shape(item.shape, top.shape):
        return None
    size = shape[0].expr if isinstance(shape[0], Sym) else shape[0]  # a symbolic size
    if not isinstance(size, (int, sympy.Expr)) or not same_dim(size, top.shape[-1]):
        return None
    params = []
    for p in (a["weight"], a["bias"]):
        if p is not None and not isinstance(p, Ref):
            return None
        params.append(p.name if p is not None else None)
    eps = a["eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    return LayerNormRows(out, x.name, ln.name, params[0], params[1], float(eps),
                         top.shape[-1])
