"""The routed experts with block-scaled fp8 weights, as one op kiln keeps whole.

    y[n] = sum_j weights[n, j] * fp8_linear(h, down[e]),  e = ids[n, j]
    h    = silu(fp8_linear(x[n], gate[e])) * fp8_linear(x[n], up[e])

kiln::moe_experts (kiln.ops.moe_experts: routing, the sorted row buffer, the fixed
order combine) with each expert's three products being kiln::fp8_linear's: gate / up
[E, I, dim] and down [E, dim, I] are float8_e4m3fn, each expert's matrix with one
fp32 scale per 128 x 128 block (gate_scale / up_scale [E, ceil(I/128),
ceil(dim/128)], down_scale [E, ceil(dim/128), ceil(I/128)]: Hugging Face's per-expert
`weight_scale_inv` stacked); the activations are quantised per token in groups of 128
(x for gate and up, h again for down) and every product accumulates in fp32 with both
scales applied per 128-wide K block. g, u, h and each pair's output are rounded to x's
dtype where fp8_linear's outputs are. DeepSeek-V3's fp8 release stores its routed
experts so: held as stored they take 1 byte a weight, not bf16's 2, and decode (bound
by reading the chosen experts) reads half the bytes.

The PyTorch implementation below defines the op (and runs on the CPU target): the
sorted form of kiln::moe_experts with kiln::fp8_linear for each product. The
generated kernel (kiln.codegen.templates.moe, its fp8 form) quantises exactly as
fp8_linear does and agrees up to fp32 summation order and where h is rounded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import DTypeError, ShapeError
from kiln.ops.fp8_linear import BLOCK, quantize_weight
from kiln.ops.moe_experts import check_operands, sorted_by_expert

_WHERE = "kiln.ops.moe_experts_fp8"


def moe_experts_fp8(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor,
                    up_scale: torch.Tensor, down: torch.Tensor,
                    down_scale: torch.Tensor) -> torch.Tensor:
    """y [N, dim] in x's dtype: each token's chosen fp8 experts' SwiGLU outputs, weighted."""
    check_operands(x, weights, ids, gate, up, down, torch.float8_e4m3fn, _WHERE)
    for name, w, s in (("gate", gate, gate_scale), ("up", up, up_scale),
                       ("down", down, down_scale)):
        _check_scale(name, w, s)
    return torch.ops.kiln.moe_experts_fp8(x, weights, ids, gate, gate_scale, up, up_scale,
                                          down, down_scale)


def scale_shape(w_shape) -> tuple[int, int, int]:
    """The block scales of stacked weights [E, R, C]: [E, ceil(R/128), ceil(C/128)]."""
    E, R, C = w_shape
    return E, -(-R // BLOCK), -(-C // BLOCK)


def _check_scale(name: str, w: torch.Tensor, scale) -> None:
    if not isinstance(scale, torch.Tensor):
        raise ShapeError(f"{name}_scale must be a tensor, got {type(scale).__name__}",
                         where=_WHERE)
    if scale.dtype != torch.float32:
        raise DTypeError(f"{name}_scale has dtype {scale.dtype}; it must be float32",
                         where=_WHERE)
    want = scale_shape(w.shape)
    if tuple(scale.shape) != want:
        raise ShapeError(f"{name}_scale has shape {list(scale.shape)}; {name} "
                         f"{list(w.shape)} in {BLOCK}x{BLOCK} blocks needs {list(want)}",
                         where=_WHERE, hint="one scale per expert and 128 x 128 block: "
                         "[E, ceil(out/128), ceil(in/128)]")


def quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked real weights [E, R, C] as (float8_e4m3fn [E, R, C], fp32 scales
    [E, ceil(R/128), ceil(C/128)]): each expert as kiln.ops.quantize_weight does."""
    if w.dim() != 3:
        raise ShapeError(f"stacked experts must be 3-d [E, out, in], got shape "
                         f"{list(w.shape)}", where="kiln.ops.quantize_experts")
    parts = [quantize_weight(w[e]) for e in range(w.shape[0])]
    return (torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))


# ---- the op ---------------------------------------------------------------------------


@torch.library.custom_op("kiln::moe_experts_fp8", mutates_args=())
def _moe_experts_fp8_op(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                        gate: torch.Tensor, gate_scale: torch.Tensor, up: torch.Tensor,
                        up_scale: torch.Tensor, down: torch.Tensor,
                        down_scale: torch.Tensor) -> torch.Tensor:
    N, dim = x.shape
    k = ids.shape[1]
    order, counts = sorted_by_expert(ids, gate.shape[0])
    flat_weights = weights.reshape(-1)
    linear = torch.ops.kiln.fp8_linear
    parts = x.new_zeros((N * k, dim))  # each pair's weighted output, at the pair's row
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        xe = x[pairs // k]
        h = F.silu(linear(xe, gate[e], gate_scale[e], None)) * \
            linear(xe, up[e], up_scale[e], None)
        out = linear(h, down[e], down_scale[e], None).float() * flat_weights[pairs, None]
        parts[pairs] = out.to(x.dtype)
    # every token's k rows in the order of j, in fp32: no dependence on the expert order
    return parts.view(N, k, dim).float().sum(1).to(x.dtype)


@_moe_experts_fp8_op.register_fake
def _(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale):
    return x.new_empty(x.shape)
