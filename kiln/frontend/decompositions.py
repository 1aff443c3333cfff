"""Decompositions kiln supplies itself, for ops some torch versions keep whole.

torch's own tables differ between versions: torch 2.11's has no Python decomposition of
aten._fused_rms_norm, which nn.RMSNorm dispatches to on a GPU, so every model using
nn.RMSNorm failed to import there. torch's entry wins where it exists; these are the
definitions kiln falls back on, in ops kiln fuses.
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


KILN_DECOMPOSITIONS = {aten._fused_rms_norm.default: fused_rms_norm}
