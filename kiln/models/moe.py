"""Routed experts in static-shape forms torch.export can capture, and DeepSeek-V3's
mixture of experts (a group-limited sigmoid router, routed experts, shared experts).
Qwen3-Next's MoE (qwen3_next.py) routes its own way and runs the same experts.

Routing (per token, in fp32 as the reference does):
  scores = sigmoid(x @ W_gate^T)                          [E]
  choice = scores + e_score_correction_bias               (selection only)
  keep the topk_group of n_group groups whose two best `choice` values sum highest,
  take the top num_experts_per_tok experts of `choice` within them;
  weights = their `scores` (normalised to sum 1 with norm_topk_prob), times
  routed_scaling_factor.
  out = sum_k weights_k * expert_{id_k}(x) + shared_experts(x)

The number of tokens each expert gets depends on the data, and torch.export needs
static shapes, so the experts run in one of three static-shape forms (`form`):

- "grouped" (prefill, larger decode batches): kiln.ops.moe_experts. The N * k
  (token, expert) pairs are sorted by expert into a row buffer of static size N * k
  (an expert has at most every pair: the bound `kiln explain` shows), and each
  expert runs once over its contiguous rows. On a GPU target that is kiln's grouped
  GEMM kernel (every expert in one launch, each expert's weights read once per tile
  of its rows, the routing done on the device); elsewhere the op's PyTorch form.
- "gathered" (tiny decode batches): each token's chosen experts' weights are read
  through the ids, w[ids] [N, k, I, dim], inside a multiply and a sum over each
  weight row (kiln compiles each product to one reduction kernel that reads every
  row at its expert's offset: no copy of the weights, no matmul). It reads only the
  chosen experts' bytes, which is what decode is bound by (V3: 8 of 256 experts, 0.7
  of 22.5 GB per layer in bf16; Qwen3-Next: 10 of 512, 63 MB of 3.2 GB), but once
  per token that chose an expert: right for a few rows only.
- "dense": every expert runs on every token and a [N, E] matrix that is zero outside
  the chosen experts combines them: E / k times the routed flops (32x for V3) and
  every expert read. A reference for tests.

"auto" picks gathered for a decode step (one token per row) of at most
GATHERED_MAX_ROWS rows, grouped otherwise. A decode module compiled for a dynamic
batch does not know its rows when traced: it goes by `decode_batch`, the most rows a
step can have (the model's setup_cache sets it to the cache's max batch).

Fp8Experts holds the experts in block-scaled fp8 (an fp8 checkpoint's, kept so, or
quantize="fp8") and has one form, kiln.ops.moe_experts_fp8: its kernel reads only the
chosen experts at decode, so no gathered fp8 form is needed.

Checkpoints in Hugging Face's layout store one tensor per expert
(model.layers.L.mlp.experts.E.gate_proj.weight); `checkpoint_slot` says which stacked
tensor and slot each fills, for every loader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln.ops
from kiln.errors import KilnError
from kiln.models.llama import MLP

GATHERED_MAX_ROWS = 4  # decode steps of at most this many rows use the gathered form
FORMS = ("auto", "grouped", "gathered", "dense")
EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class MLPSizes:
    """What llama.MLP reads from its config: a SwiGLU MLP of these sizes, no biases."""

    dim: int
    intermediate_size: int
    mlp_bias: bool = False


class Router(nn.Module):
    """HF's `mlp.gate`: scores every expert, picks num_experts_per_tok of them."""

    def tensor_parallel_seeds(self) -> dict:
        """A router scores every expert of a whole row: whole on every rank."""
        return {"weight": None, "e_score_correction_bias": None}

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.dim))
        # Kept in fp32 whatever the model's dtype, like the reference.
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (weights [N, k] fp32, expert ids [N, k])."""
        cfg = self.cfg
        N = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        groups = choice.view(N, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_score = groups.topk(2, dim=-1).values.sum(-1)  # [N, n_group]
        kept = group_score.topk(cfg.topk_group, dim=-1).indices
        # which groups were kept, as a comparison kiln fuses (a scatter into zeros ran
        # as three torch kernels a layer in decode)
        group_ids = torch.arange(cfg.n_group, device=kept.device)
        group_mask = (kept[:, :, None] == group_ids).any(dim=1)  # [N, n_group]
        choice = groups.masked_fill(~group_mask[:, :, None], float("-inf")).view(N, -1)
        ids = choice.topk(cfg.n_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, ids


def checkpoint_slot(name: str) -> tuple[str, int] | None:
    """(the stacked Experts tensor, the expert's slot) that a checkpoint's per-expert
    tensor model.layers.L.mlp.experts.E.<gate|up|down>_proj.weight fills (an fp8
    checkpoint's ...<proj>.weight_scale_inv: Fp8Experts' <proj>_scale_inv); None for
    any other name."""
    parts = name.split(".")
    if (len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[3:5] == ["mlp", "experts"]
            and parts[5].isdigit() and parts[6] in EXPERT_WEIGHTS
            and parts[7] in ("weight", "weight_scale_inv")):
        suffix = "_scale_inv" if parts[7] == "weight_scale_inv" else ""
        return ".".join(parts[:5] + [parts[6] + suffix]), int(parts[5])
    return None


class Experts(nn.Module):
    """The routed experts' SwiGLU weights stacked: gate/up [E, I, dim], down [E, dim, I]."""

    def __init__(self, n_experts: int, intermediate: int, dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(n_experts, intermediate, dim))
        self.up_proj = nn.Parameter(torch.empty(n_experts, intermediate, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, intermediate))
        self.expert_parallel = False  # tensor parallelism cuts experts, not widths

    def tensor_parallel_seeds(self) -> dict:
        """Tensor parallel over each expert's intermediate width (gate and up by rows,
        down by columns; kiln::moe_experts and the gathered form both keep the cut), or
        with `expert_parallel` set, by expert (every rank runs E / T experts; the
        grouped form only: the gathered one would gather every expert's weights)."""
        axes = (0, 0, 0) if self.expert_parallel else (1, 1, 2)
        return dict(zip(EXPERT_WEIGHTS, axes))

    def gathered(self, x, weights, ids, shared=None):
        """x [..., dim], weights/ids [..., k]: only the chosen experts' weights are read.

        Each product is a multiply and a sum over the weight's rows read through the
        ids, in fp32, not a matmul of w[ids]: kiln fuses the gather into the sum's
        reduction kernel (every weight row read once, at its expert's offset), where a
        matmul would first copy the chosen experts' weights (read, write, read again).
        Eager PyTorch materialises the gathered rows either way.

        `shared`: (a shared expert of the experts' widths (gate_proj, up_proj,
        down_proj Linears), its weight [..., 1]), run as one more expert of every row:
        its weights concatenated after the chosen ones, so the same two kernels read
        them and no launch of its own (two small GEMVs) is left."""
        xf = x.float()[..., None, None, :]  # [..., 1, 1, dim]
        gate, up, down = self.gate_proj[ids], self.up_proj[ids], self.down_proj[ids]
        if shared is not None:
            mlp, scale = shared
            lead = ids.shape[:-1]
            gate, up, down = (torch.cat([w, lin.weight.expand(*lead, 1, *lin.weight.shape)], -3)
                              for w, lin in ((gate, mlp.gate_proj), (up, mlp.up_proj),
                                             (down, mlp.down_proj)))
            weights = torch.cat([weights, scale.float()], -1)
        g = (xf * gate.float()).sum(-1)  # [..., k, I]
        u = (xf * up.float()).sum(-1)
        h = (F.silu(g) * u).to(x.dtype).float()  # rounded where a matmul's output would be
        y = (h[..., None, :] * down.float()).sum(-1)  # [..., k, dim]
        return (y * weights[..., None]).sum(-2).to(x.dtype)

    def grouped(self, x, weights, ids):
        """The pairs sorted by expert, each expert once over its rows (kiln.ops)."""
        return kiln.ops.moe_experts(x, weights, ids, self.gate_proj, self.up_proj,
                                    self.down_proj)

    def dense(self, x, weights, ids):
        """Every expert on every token, combined by weights that are 0 off the choice."""
        combine = torch.zeros(x.shape[0], self.gate_proj.shape[0], dtype=torch.float32,
                              device=x.device).scatter(1, ids, weights)  # [N, E]
        h = F.silu(torch.einsum("nd,eid->nei", x, self.gate_proj))
        h = h * torch.einsum("nd,eid->nei", x, self.up_proj)
        y = torch.einsum("nei,edi->ned", h, self.down_proj)
        return (y.float() * combine[:, :, None]).sum(1).to(x.dtype)


class Fp8Experts(nn.Module):
    """The routed experts in block-scaled fp8: gate/up [E, I, dim] and down [E, dim, I]
    float8_e4m3fn, each expert's matrix with one fp32 scale per 128 x 128 block
    (<proj>_scale_inv [E, ceil(out/128), ceil(in/128)]: the real weight is weight *
    scale, Hugging Face's per-expert weight_scale_inv stacked). Run by
    kiln.ops.moe_experts_fp8 (every product fp8_linear's): half bf16's bytes.

    It has one form: the grouped op. At decode its kernel reads only the chosen
    experts' weights (a tile per expert that has rows), which is what the gathered
    form is for with bf16 experts, so "gathered" (and "dense", a bf16 reference) run
    it too."""

    def __init__(self, n_experts: int, intermediate: int, dim: int, device=None):
        super().__init__()
        for name, shape in (("gate_proj", (n_experts, intermediate, dim)),
                            ("up_proj", (n_experts, intermediate, dim)),
                            ("down_proj", (n_experts, dim, intermediate))):
            w = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.ones(kiln.ops.expert_scale_shape(shape), device=device)
            setattr(self, name, nn.Parameter(w, requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(scale, requires_grad=False))
        self.expert_parallel = False  # tensor parallelism cuts experts, not widths

    def tensor_parallel_seeds(self) -> dict:
        """With `expert_parallel` set, by expert (weights and block scales alike);
        else the op's rule cuts each expert's width in whole 128-blocks."""
        if not self.expert_parallel:
            return {}
        return dict.fromkeys([n + s for n in EXPERT_WEIGHTS for s in ("", "_scale_inv")], 0)

    @classmethod
    def from_experts(cls, experts: Experts) -> Fp8Experts:
        """`experts` quantised expert by expert in 128 x 128 blocks."""
        E, inter, dim = experts.gate_proj.shape
        fp8 = cls(E, inter, dim, device="meta")
        for name in EXPERT_WEIGHTS:
            q, s = kiln.ops.quantize_experts(getattr(experts, name).detach())
            setattr(fp8, name, nn.Parameter(q, requires_grad=False))
            setattr(fp8, f"{name}_scale_inv", nn.Parameter(s, requires_grad=False))
        fp8.expert_parallel = experts.expert_parallel
        return fp8

    def grouped(self, x, weights, ids):
        return kiln.ops.moe_experts_fp8(
            x, weights, ids, self.gate_proj, self.gate_proj_scale_inv, self.up_proj,
            self.up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv)

    def gathered(self, x, weights, ids):
        """The grouped op: at decode its kernel reads only the chosen experts."""
        return self.grouped(x, weights, ids)

    dense = gathered

    def extra_repr(self) -> str:
        E, inter, dim = self.gate_proj.shape
        return f"{E} experts, dim {dim}, intermediate {inter}, fp8 e4m3 in 128x128 blocks"


class RoutedMoE(nn.Module):
    """What every routed MoE shares: an `experts` (Experts, set by the subclass) run in
    the form `form` asks for, "auto" choosing by the call's rows and tokens."""

    def __init__(self):
        super().__init__()
        self.form = "auto"
        self.decode_batch = 1  # the most rows a decode step routes (setup_cache sets it)

    def run_experts(self, flat, weights, ids, B, T) -> torch.Tensor:
        """flat [B * T, dim], weights [B * T, k] fp32, ids [B * T, k] -> [B * T, dim]."""
        return getattr(self.experts, self.form_for(B, T))(flat, weights, ids)

    def form_for(self, B, T) -> str:
        """The experts' form for a call of B rows of T tokens. Under torch.export a
        dynamic size is a SymInt: only a decode module's T is an int, and its B is one
        only when the batch is static."""
        if self.form != "auto":
            return self.form
        decode = isinstance(T, int) and T == 1
        rows = B if isinstance(B, int) else self.decode_batch
        return "gathered" if decode and rows <= GATHERED_MAX_ROWS else "grouped"


def quantize_experts_fp8(model: nn.Module) -> None:
    """Every RoutedMoE's bf16/fp32 Experts of `model` as Fp8Experts, in place."""
    for m in model.modules():
        if isinstance(m, RoutedMoE) and isinstance(m.experts, Experts):
            m.experts = Fp8Experts.from_experts(m.experts)


def use_fp8_experts_layout(model: nn.Module, layers) -> None:
    """Before loading an fp8 checkpoint: the routed experts of `layers` (indices into
    model.model.layers, on the meta device) become Fp8Experts, so their e4m3 weights and
    block scales load as stored."""
    for i in layers:
        moe = model.model.layers[i].mlp
        E, inter, dim = moe.experts.gate_proj.shape
        moe.experts = Fp8Experts(E, inter, dim, device=moe.experts.gate_proj.device)


def use_expert_form(model: nn.Module, form: str) -> None:
    """Run every RoutedMoE of `model` in `form` (FORMS; tests compare them)."""
    if form not in FORMS:
        raise KilnError(f"unknown experts form {form!r}", hint=", ".join(FORMS))
    for m in model.modules():
        if isinstance(m, RoutedMoE):
            m.form = form


def use_expert_parallel(model: nn.Module, on: bool = True) -> None:
    """Under tensor parallelism, cut every routed MoE of `model` by expert (each rank
    holds E / T experts and runs them on every token; DeepSeek's layout) instead of by
    each expert's intermediate width; its experts then run grouped (kiln::moe_experts):
    the gathered form would gather every expert's weights to each rank."""
    for m in model.modules():
        if isinstance(m, RoutedMoE):
            m.experts.expert_parallel = on
            if on:
                m.form = "grouped"


def set_decode_batch(model: nn.Module, rows: int) -> None:
    """Tell every RoutedMoE of `model` the most rows a decode step routes (the cache's
    max batch): auto's choice for a decode module with a dynamic batch."""
    for m in model.modules():
        if isinstance(m, RoutedMoE):
            m.decode_batch = rows


class MoE(RoutedMoE):
    """HF's DeepseekV3MoE: router, routed experts, shared experts.

    n_shared_experts 0 means no shared expert at all, where transformers builds one of
    width 0 (its checkpoints store those empty weights; the loader skips them): a
    zero-width MLP is three empty products each layer, and an fp8 one broke the fp8
    linear's reshapes."""

    def __init__(self, cfg):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.dim)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = MLP(MLPSizes(cfg.dim,
                                               cfg.moe_intermediate_size * cfg.n_shared_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        weights, ids = self.gate(flat)
        y = self.run_experts(flat, weights, ids, B, T).view(B, T, D)
        return y if self.shared_experts is None else y + self.shared_experts(x)
