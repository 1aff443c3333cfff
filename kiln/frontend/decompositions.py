"""Decompositions kiln supplies itself, for ops some torch versions keep whole.

torch's own tables differ between versions and devices: on a GPU, torch 2.11 decomposes
aten.rms_norm (what nn.RMSNorm calls) into aten._fused_rms_norm, a fused kernel with no
Python decomposition there, so every model using nn.RMSNorm failed to import.
OVERRIDES replace torch's entry (its result would be an op kiln cannot compile);
FALLBACKS are used where torch has none. Both are written in ops kiln fuses.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def fused_rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                   eps: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x) * weight in x's dtype, 1 / rms in fp32), computed in fp32 at least."""
    dims = list(range(x.dim() - len(normalized_shape), x.dim()))
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    if eps is None:
        eps = torch.finfo(wide.dtype).eps
    rstd = torch.rsqrt(wide.pow(2).mean(dim=dims, keepdim=True) + eps)
    out = wide * rstd
    if weight is not None:
        out = out * weight
    return out.to(x.dtype), rstd


def rms_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    return fused_rms_norm(x, normalized_shape, weight, eps)[0]


OVERRIDES = {aten.rms_norm.default: rms_norm}
FALLBACKS = {aten._fused_rms_norm.default: fused_rms_norm}
