"""A block-scaled fp8 linear layer (DeepSeek-V3's), as one op kiln keeps whole.

    y = x @ dequant(w)^T + bias

w [N, K] is float8_e4m3fn with one fp32 scale per 128 x 128 block, `w_scale_inv`
[ceil(N/128), ceil(K/128)] (Hugging Face's `weight_scale_inv`: the real weight is
w * scale). The activations x [..., K] are quantised per token in groups of 128 along
K to e4m3 (scale = amax / 448 per group), and the product accumulates in fp32 with
both scales applied per 128-wide K block; the output has x's dtype.

It is a torch.library custom op (`kiln::fp8_linear`) so torch.export keeps it as one
node: unrolled into ATen ops, the activation quantisation would be a chain of
reductions and casts no template could recognise. Its two halves are ops too:
`kiln::fp8_quantize` (x -> e4m3 values and per-group scales) and `kiln::fp8_scaled_mm`
(the block-scaled product of quantised x and the weight); fp8_linear is exactly their
composition. kiln's graph stage splits a linear over many tokens into the two
(kiln.graph.split_fp8_linear), so x is quantised once, not once per output tile. The
PyTorch implementations below define the ops (and run on the CPU target); the generated
kernels (kiln/codegen/templates/fp8_matmul) quantise exactly as `quantize_activations`
does, so they agree up to fp32 summation order.
"""

from __future__ import annotations

import torch

from kiln.errors import DTypeError, ShapeError

BLOCK = 128  # the K group of an activation scale; a weight scale's block is BLOCK x BLOCK
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
AMAX_FLOOR = 1e-10  # an all-zero group gets a tiny scale, not a division by zero
_ACTIVATIONS = (torch.float16, torch.bfloat16, torch.float32)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) times the block-scaled fp8 weight [N, K]^T: [..., N]."""
    _check(x, weight, weight_scale_inv, bias)
    return torch.ops.kiln.fp8_linear(x, weight, weight_scale_inv, bias)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A real weight [N, K] as (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/128),
    ceil(K/128)]): each 128 x 128 block scaled so its largest magnitude is 448."""
    where = "kiln.ops.quantize_weight"
    if w.dim() != 2:
        raise ShapeError(f"the weight must be 2-d [N, K], got shape {list(w.shape)}",
                         where=where)
    if w.dtype not in _ACTIVATIONS:
        raise DTypeError(f"the weight has dtype {w.dtype}; quantize a float16, bfloat16 or "
                         "float32 weight", where=where)
    N, K = w.shape
    pn, pk = -N % BLOCK, -K % BLOCK
    blocks = torch.nn.functional.pad(w.float(), (0, pk, 0, pn))
    blocks = blocks.reshape((N + pn) // BLOCK, BLOCK, (K + pk) // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR)
    # amax times fp32(1 / 448), not amax / 448: torch's CUDA division by a scalar is a
    # multiply by its reciprocal and its CPU one a division; this is the same everywhere
    scale = amax * (1.0 / FP8_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(N + pn, K + pk)[:N, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def dequantize_weight(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The fp32 weight a (float8, 128 x 128 block scale) pair stands for."""
    N, K = w.shape
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)
    return w.float() * scale[:, :K]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as (fp8 values [..., K], fp32 scales [..., ceil(K/128)]): per token,
    each 128-wide group of K times 448 / amax, rounded to e4m3; its scale amax x (1 / 448)."""
    K = x.shape[-1]
    pad = -K % BLOCK
    groups = torch.nn.functional.pad(x.float(), (0, pad))
    groups = groups.reshape(*x.shape[:-1], (K + pad) // BLOCK, BLOCK)
    amax = groups.abs().amax(-1).clamp(min=AMAX_FLOOR)
    # x * (448 / amax), with 448 / amax as torch computes `448 / tensor` (reciprocal,
    # then times 448: two roundings), spelled out so the kernels can do the same
    q = (groups * (amax.reciprocal() * FP8_MAX)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    # amax times fp32(1 / 448), not amax / 448: torch's CUDA division by a scalar is a
    # multiply by its reciprocal and its CPU one a division; this is the same everywhere
    scale = amax * (1.0 / FP8_MAX)
    q = q.to(torch.float8_e4m3fn)
    return q.reshape(*x.shape[:-1], K + pad)[..., :K].contiguous(), scale


def _check(x, weight, scale_inv, bias) -> None:
    """Shapes and dtypes a caller can get wrong, said in the op's own terms."""
    where = "kiln.ops.fp8_linear"
    for name, t in (("x", x), ("weight", weight), ("weight_scale_inv", scale_inv)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"{name} must be a tensor, got {type(t).__name__}", where=where)
    if weight.dtype != torch.float8_e4m3fn:
        raise DTypeError(f"weight has dtype {weight.dtype}; it must be torch.float8_e4m3fn",
                         where=where, hint="kiln.ops.quantize_weight(w) makes the fp8 "
                         "weight and its block scales from a real one")
    if x.dtype not in _ACTIVATIONS:
        raise DTypeError(f"x has dtype {x.dtype}; it must be float16, bfloat16 or float32",
                         where=where)
    if scale_inv.dtype != torch.float32:
        raise DTypeError(f"weight_scale_inv has dtype {scale_inv.dtype}; it must be float32",
                         where=where)
    if weight.dim() != 2 or x.dim() < 1:
        raise ShapeError(f"weight must be 2-d [N, K] and x [..., K]; got weight "
                         f"{list(weight.shape)}, x {list(x.shape)}", where=where)
    N, K = weight.shape
    if x.shape[-1] != K:
        raise ShapeError(f"x has {x.shape[-1]} features, the weight [N, K] = {[N, K]} "
                         f"expects K = {K}", where=where, hint="x is [..., K]")
    want = [-(-N // BLOCK), -(-K // BLOCK)]
    if list(scale_inv.shape) != want:
        raise ShapeError(f"weight_scale_inv has shape {list(scale_inv.shape)}; a {N}x{K} "
                         f"weight in {BLOCK}x{BLOCK} blocks needs {want}", where=where,
                         hint="one scale per 128 x 128 block: [ceil(N/128), ceil(K/128)]")
    if bias is not None and (not isinstance(bias, torch.Tensor) or list(bias.shape) != [N]):
        got = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ShapeError(f"bias must be a [{N}] tensor, got {got}", where=where)


# ---- the op ---------------------------------------------------------------------------


@torch.library.custom_op("kiln::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    xq, xs = quantize_activations(x)
    return _scaled_mm(xq, xs, weight, weight_scale_inv, bias, x.dtype)


@_fp8_linear_op.register_fake
def _(x, weight, weight_scale_inv, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("kiln::fp8_quantize", mutates_args=())
def _fp8_quantize_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as (e4m3 values [..., K], fp32 scales [..., ceil(K/128)])."""
    return quantize_activations(x)


@_fp8_quantize_op.register_fake
def _(x):
    groups = -(-x.shape[-1] // BLOCK)
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], groups), dtype=torch.float32))


@torch.library.custom_op("kiln::fp8_scaled_mm", mutates_args=())
def _fp8_scaled_mm_op(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                      weight_scale_inv: torch.Tensor, bias: torch.Tensor | None,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """Quantised x [..., K] (kiln::fp8_quantize's pair) times the fp8 weight: [..., N]."""
    return _scaled_mm(xq, x_scale, weight, weight_scale_inv, bias, out_dtype)


@_fp8_scaled_mm_op.register_fake
def _(xq, x_scale, weight, weight_scale_inv, bias, out_dtype):
    return xq.new_empty((*xq.shape[:-1], weight.shape[0]), dtype=out_dtype)


def _scaled_mm(xq, xs, weight, weight_scale_inv, bias, out_dtype) -> torch.Tensor:
    N, K = weight.shape
    lead = xq.shape[:-1]
    xq, xs = xq.reshape(-1, K).float(), xs.reshape(-1, xs.shape[-1])
    wq = weight.float()
    # Per 128-wide K block b: (xq_b @ wq_b^T) * xs_b * ws_b, summed over b in fp32.
    y = xs.new_zeros((xq.shape[0], N), dtype=torch.float32)
    for b, k0 in enumerate(range(0, K, BLOCK)):
        ws = weight_scale_inv[:, b].repeat_interleave(BLOCK)[:N]
        y += (xq[:, k0:k0 + BLOCK] @ wq[:, k0:k0 + BLOCK].t()) * xs[:, b, None] * ws
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*lead, N).to(out_dtype)
