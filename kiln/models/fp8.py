"""Block-scaled fp8 linears (`quantize="fp8"`, fp8 checkpoints): the Llama families
and DeepSeek-V3's attention and dense / shared-expert MLPs.

`Fp8Linear` holds an e4m3 weight [N, K] and its fp32 scales per 128 x 128 block under
Hugging Face's names (`weight`, `weight_scale_inv`: the real weight is weight * scale),
so an fp8 checkpoint in HF's layout (quantization_config quant_method "fp8") loads into
it as it is. Its forward is kiln.ops.fp8_linear: activations quantised per token in
groups of 128, fp32 accumulation; one op kiln generates a kernel for on GPU targets and
runs as its PyTorch form on the CPU.

Only the decoder layers' projections become fp8 (Llama: q, k, v, o, gate, up, down;
DeepSeek-V3: its latent attention's q / q_a / q_b, kv_a, kv_b and o, and the gate, up
and down of the dense MLPs and shared experts), and the routed experts (stacked [E,
...] parameters, not linears: moe.Fp8Experts, run by kiln::moe_experts_fp8 with the
same block scales): the embedding, the norms, the router and the LM head keep the
model's dtype, as fp8 releases do.
"""

from __future__ import annotations

import torch
from torch import nn

import kiln.ops
from kiln.errors import ArgumentError, CheckpointError
from kiln.models.moe import Experts, Fp8Experts, RoutedMoE, quantize_experts_fp8

QUANTIZATIONS = ("fp8",)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LATENT_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # MLA's
# where a decoder layer's linears sit (Qwen3-Next's shared expert is singular)
PARTS = ("self_attn", "mlp", "mlp.shared_experts", "mlp.shared_expert")
BLOCK = (128, 128)


class Fp8Linear(nn.Module):
    """y = x @ (weight * block scale)^T + bias, with x quantised to fp8 per token group."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 bias_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        blocks = (-(-out_features // BLOCK[0]), -(-in_features // BLOCK[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.ones(blocks, device=device),
                                             requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantised in 128 x 128 blocks (its bias kept as it is)."""
        w = linear.weight.detach()
        fp8 = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  w.dtype, device="meta")
        q, s = kiln.ops.quantize_weight(w)
        fp8.weight = nn.Parameter(q, requires_grad=False)
        fp8.weight_scale_inv = nn.Parameter(s, requires_grad=False)
        if linear.bias is not None:
            fp8.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kiln.ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8 e4m3 in {BLOCK[0]}x{BLOCK[1]} blocks")


def check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in QUANTIZATIONS:
        raise ArgumentError(f"unknown quantization {quantize!r}",
                            hint=f"one of: {', '.join(QUANTIZATIONS)} (or none)")


def _projections(model: nn.Module):
    """(parent module, attribute, checkpoint name) of each decoder-layer projection."""
    for i, layer in enumerate(model.model.layers):
        for kind in PARTS:
            part = _submodule(layer, kind)
            for name in PROJECTIONS + LATENT_PROJECTIONS:
                if isinstance(getattr(part, name, None), nn.Linear | Fp8Linear):
                    yield part, name, f"model.layers.{i}.{kind}.{name}"


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def quantize_fp8(model: nn.Module) -> nn.Module:
    """Replace `model`'s projections (materialised nn.Linear) by Fp8Linear and its routed
    experts by moe.Fp8Experts, in place."""
    for part, name, _ in _projections(model):
        linear = getattr(part, name)
        if isinstance(linear, nn.Linear):
            setattr(part, name, Fp8Linear.from_linear(linear))
    quantize_experts_fp8(model)
    return model


def use_quantized_layout(model: nn.Module) -> None:
    """quantize_fp8's layout for a model on the meta device, holding nothing yet: its
    projections Fp8Linear, its routed experts Fp8Experts. A multi-device load quantises
    each rank's slices as it reads them (kiln.models.rank_weights), in the same blocks."""
    for part, name, _ in _projections(model):
        linear = getattr(part, name)
        if isinstance(linear, nn.Linear):
            setattr(part, name, Fp8Linear(linear.in_features, linear.out_features,
                                          linear.bias is not None, linear.weight.dtype,
                                          device="meta"))
    for m in model.modules():
        if isinstance(m, RoutedMoE) and isinstance(m.experts, Experts):
            fp8 = Fp8Experts(*m.experts.gate_proj.shape, device="meta")
            fp8.expert_parallel = m.experts.expert_parallel
            m.experts = fp8


def check_fp8_config(hf_cfg: dict, where: str) -> None:
    """An fp8 checkpoint's quantization_config that Fp8Linear can hold as it is."""
    quant = hf_cfg.get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size") or BLOCK)
    if block != BLOCK:
        raise CheckpointError(f"fp8 weights in {block[0]}x{block[1]} blocks; kiln's fp8 "
                              f"linear takes {BLOCK[0]}x{BLOCK[1]}", where=where)
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"fp8 activation scheme {quant['activation_scheme']!r}; "
                              "kiln's fp8 linear quantises activations per token "
                              "(dynamic)", where=where)


def use_fp8_layout(model: nn.Module, hf_cfg: dict, where: str, stored=None) -> None:
    """Before loading an fp8 checkpoint: the projections of `model` (on the meta device)
    become Fp8Linear, so their weights and scales load as they are.

    Which: with `stored` (the checkpoint's tensor names), exactly those stored with a
    `weight_scale_inv` (DeepSeek's release names none in modules_to_not_convert);
    without it, all but those the config's modules_to_not_convert names (kept
    nn.Linear, stored in the model's dtype)."""
    check_fp8_config(hf_cfg, where)
    skip = (hf_cfg.get("quantization_config") or {}).get("modules_to_not_convert") or ()
    for part, name, full in _projections(model):
        if stored is not None:
            if f"{full}.weight_scale_inv" not in stored:
                continue
        elif any(s in full for s in skip):
            continue
        linear = getattr(part, name)
        setattr(part, name, Fp8Linear(linear.in_features, linear.out_features,
                                      linear.bias is not None, linear.weight.dtype,
                                      device=linear.weight.device))


def is_fp8_checkpoint(hf_cfg: dict) -> bool:
    return (hf_cfg.get("quantization_config") or {}).get("quant_method") == "fp8"


def keeps_fp8(keep_fp8: bool | None, hf_cfg: dict, on_gpu: bool, where: str,
              can_dequantize: bool = True) -> bool:
    """Whether a checkpoint's fp8 weights load as fp8 (Fp8Linear): `keep_fp8`, or by
    default (None) on GPUs only. A loader that cannot dequantise (the Llama families')
    always keeps them. keep_fp8=True for a checkpoint without fp8 weights is an error,
    not a silent no-op: quantize="fp8" is the way to make them."""
    fp8 = is_fp8_checkpoint(hf_cfg)
    if keep_fp8 and not fp8:
        raise ArgumentError(f"keep_fp8=True, but {where} has no fp8 weights",
                            hint="quantize='fp8' makes fp8 weights at load (an fp8 "
                            "checkpoint's quantization_config.quant_method is 'fp8')")
    if not fp8:
        return False
    if keep_fp8 is False and not can_dequantize:
        raise ArgumentError(f"keep_fp8=False: this family's fp8 checkpoints ({where}) "
                            "load as fp8 only", hint="leave keep_fp8 unset")
    return on_gpu or not can_dequantize if keep_fp8 is None else keep_fp8
