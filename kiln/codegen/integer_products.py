"""Integer matrix products for the extern path on GPUs, where torch has none.

ATen's CUDA mm/bmm/addmm/baddbmm reject integer dtypes ("addmm_cuda" not implemented
for 'Long'), while the CPU computes them; a model that multiplies integer matrices
(index arithmetic, counting) would compile for the GPU and then fail when called. The
product is a broadcast multiply summed over K, a K-slice at a time so the temporary
stays small; the sum is cast back to the operands' dtype, which wraps around exactly
as the CPU's integer product does.
"""

from __future__ import annotations

import torch

_TEMP_ELEMENTS = 1 << 24  # largest broadcast temporary, per K slice


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    out = torch.zeros((*lead, m, n), dtype=torch.int64, device=a.device)
    per_k = max(1, _TEMP_ELEMENTS // max(1, out.numel()))
    for k0 in range(0, k, per_k):
        k1 = min(k, k0 + per_k)
        out += (a[..., :, k0:k1, None].long() * b[..., None, k0:k1, :].long()).sum(-2)
    return out.to(torch.promote_types(a.dtype, b.dtype))


def mm(a, b):
    return _product(a, b)


def addmm(bias, a, b, *, beta=1, alpha=1):
    return (beta * bias + alpha * _product(a, b)).to(_product_dtype(bias, a, b))


def baddbmm(bias, a, b, *, beta=1, alpha=1):
    return addmm(bias, a, b, beta=beta, alpha=alpha)


def _product_dtype(*xs) -> torch.dtype:
    dtype = xs[0].dtype
    for x in xs[1:]:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


# The core ATen products, by target name; bmm is mm with a batch dim.
INTEGER_PRODUCTS = {"aten.mm.default": mm, "aten.bmm.default": mm,
                    "aten.addmm.default": addmm, "aten.baddbmm.default": baddbmm}


def integer_product(target: str, dtype: torch.dtype | None, device: torch.device):
    """The replacement for op `target` producing `dtype` on `device`, or None."""
    if device.type == "cpu" or dtype is None or dtype.is_floating_point or dtype.is_complex:
        return None
    return INTEGER_PRODUCTS.get(target)
