"""Decompositions kiln supplies itself, for ops some torch versions keep whole.

torch's own tables differ between versions and devices: on a GPU, torch 2.11 decomposes
aten.rms_norm (what nn.RMSNorm calls) into aten._fused_rms_norm, a fused kernel with no
Python decomposition there, so every model using nn.RMSNorm failed to import.
OVERRIDES replace torch's entry (its result would be an op kiln cannot compile);
FALLBACKS are used where torch has none (fused_rms_norm; histc, which transformers'
MoE layers count their experts' tokens with; masked_scatter, which multimodal models
place image features with). All are written in ops kiln fuses.

DECOMPOSE lists ops export keeps whole whose torch decomposition is plain elementwise
math and gathers: decomposed, they fuse with their neighbours instead of running as
PyTorch's own op. Not every decomposition qualifies (bucketize's loops over data).
"""

from __future__ import annotations

import struct

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


def eval_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                    running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eval-mode BatchNorm as an affine map per channel (dim 1), in fp32 at least; the
    saved statistics, which only training uses, are empty as in ATen. (torch's own
    decomposition calls the training op, which export refuses as non-functional.)"""
    shape = [1, -1] + [1] * (x.dim() - 2)
    wide = torch.promote_types(x.dtype, torch.float32)
    scale = torch.rsqrt(running_var.to(wide) + eps)
    if weight is not None:
        scale = scale * weight.to(wide)
    shift = -running_mean.to(wide) * scale
    if bias is not None:
        shift = shift + bias.to(wide)
    out = x.to(wide) * scale.reshape(shape) + shift.reshape(shape)
    empty = x.new_zeros(0, dtype=wide)
    return out.to(x.dtype), empty, empty.clone()


def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """torch.histc as a comparison of each element's bin with every bin, summed.

    Why: transformers 5's MoE layers (OLMoE, Qwen2/3-MoE, GPT-OSS, DeepSeek-V2, ...)
    count each expert's tokens with histc of the chosen expert ids (bins = experts),
    and its ATen kernel was the one op of those models kiln ran as PyTorch's. The bin
    of x is floor((x - min) * bins / (max - min)) as ATen computes it, x == max in the
    last bin, elements outside [min, max] (and NaN) in none; min == max takes the
    data's range, widened by 1 each way when that is empty too. [elements, bins]
    comparisons: a router's counts are small; a large histogram is better left to ATen
    (the user's choice of op)."""
    flat = x.reshape(-1)
    if min == max:  # the data's own range
        lo, hi = flat.min(), flat.max()
        empty = lo == hi
        lo, hi = torch.where(empty, lo - 1, lo), torch.where(empty, hi + 1, hi)
        width = hi - lo
    else:  # the edges and their difference rounded to x's dtype first, as ATen has them
        lo, hi = _rounded(min, x.dtype), _rounded(max, x.dtype)
        width = _rounded(hi - lo, x.dtype)
    inside = (flat >= lo) & (flat <= hi)
    pos = ((flat - lo) * bins / width).floor().clamp(0, bins - 1).to(torch.int64)
    hits = (pos[:, None] == torch.arange(bins, device=x.device)) & inside[:, None]
    return hits.sum(0).to(x.dtype)


def masked_scatter(x: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """x with the elements where `mask` (broadcast to x) is true taken from `source` in
    order: the k-th true element reads source's k-th element (a running count of the
    mask, then a gather and a select).

    Why: Llava and the other multimodal models write their image features into the
    text embedding with masked_scatter, the one op of theirs kiln ran as PyTorch's."""
    flat = mask.expand(x.shape).reshape(-1)
    order = (torch.cumsum(flat.to(torch.int64), 0) - 1).clamp(min=0)
    placed = source.reshape(-1)[order]
    return torch.where(flat, placed, x.reshape(-1)).reshape(x.shape)


def _rounded(v: float, dtype: torch.dtype) -> float:
    """`v` rounded to fp32 where `dtype` is fp32 (Python's floats are fp64)."""
    return struct.unpack("f", struct.pack("f", v))[0] if dtype == torch.float32 else v


OVERRIDES = {
    aten.rms_norm.default: rms_norm,
    aten._native_batch_norm_legit_no_training.default: eval_batch_norm,
}
DECOMPOSE = {
    aten.upsample_bilinear2d.vec, aten.upsample_bilinear2d.default,
    aten.upsample_nearest2d.default, aten.upsample_nearest1d.default,
    aten.upsample_nearest3d.default,
    # batch norm with no running statistics: a mean and variance (BiT's weight
    # standardisation, F.batch_norm(w, None, None, training=True))
    aten._native_batch_norm_legit.no_stats,
}
FALLBACKS = {aten._fused_rms_norm.default: fused_rms_norm, aten.histc.default: histc,
             aten.masked_scatter.default: masked_scatter}
