"""Block-scaled fp8 linears for the Llama families (`quantize="fp8"`, fp8 checkpoints).

`Fp8Linear` holds an e4m3 weight [N, K] and its fp32 scales per 128 x 128 block under
Hugging Face's names (`weight`, `weight_scale_inv`: the real weight is weight * scale),
so an fp8 checkpoint in HF's layout (quantization_config quant_method "fp8") loads into
it as it is. Its forward is kiln.ops.fp8_linear: activations quantised per token in
groups of 128, fp32 accumulation; one op kiln generates a kernel for on GPU targets and
runs as its PyTorch form on the CPU.

Only the decoder layers' projections become fp8 (q, k, v, o, gate, up, down): the
embedding, the norms and the LM head keep the model's dtype, as fp8 releases do.
"""

from __future__ import annotations

import torch
from torch import nn

import kiln.ops
from kiln.errors import ArgumentError, CheckpointError

QUANTIZATIONS = ("fp8",)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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


def _projections(model: nn.Module, skip=()):
    """(parent module, attribute) of each decoder-layer projection, but those whose
    checkpoint name contains an entry of `skip` (HF's modules_to_not_convert)."""
    for i, layer in enumerate(model.model.layers):
        for kind, part in (("self_attn", layer.self_attn), ("mlp", layer.mlp)):
            for name in PROJECTIONS:
                full = f"model.layers.{i}.{kind}.{name}"
                if isinstance(getattr(part, name, None), nn.Linear | Fp8Linear) and \
                        not any(s in full for s in skip):
                    yield part, name


def quantize_fp8(model: nn.Module) -> nn.Module:
    """Replace `model`'s projections (materialised nn.Linear) by Fp8Linear, in place."""
    for part, name in _projections(model):
        linear = getattr(part, name)
        if isinstance(linear, nn.Linear):
            setattr(part, name, Fp8Linear.from_linear(linear))
    return model


def use_fp8_layout(model: nn.Module, hf_cfg: dict, where: str) -> None:
    """Before loading an fp8 checkpoint: the projections of `model` (on the meta device)
    become Fp8Linear, so its weights and scales load as they are; those the config's
    modules_to_not_convert names stay nn.Linear (stored in the model's dtype)."""
    quant = hf_cfg.get("quantization_config") or {}
    block = tuple(quant.get("weight_block_size") or BLOCK)
    if block != BLOCK:
        raise CheckpointError(f"fp8 weights in {block[0]}x{block[1]} blocks; kiln's fp8 "
                              f"linear takes {BLOCK[0]}x{BLOCK[1]}", where=where)
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"fp8 activation scheme {quant['activation_scheme']!r}; "
                              "kiln's fp8 linear quantises activations per token "
                              "(dynamic)", where=where)
    for part, name in _projections(model, quant.get("modules_to_not_convert") or ()):
        linear = getattr(part, name)
        setattr(part, name, Fp8Linear(linear.in_features, linear.out_features,
                                      linear.bias is not None, linear.weight.dtype,
                                      device=linear.weight.device))


def is_fp8_checkpoint(hf_cfg: dict) -> bool:
    return (hf_cfg.get("quantization_config") or {}).get("quant_method") == "fp8"
