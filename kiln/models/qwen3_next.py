"""Qwen3-Next: a hybrid of gated-delta-rule linear attention and gated full attention,
with a mixture of experts, in one readable file.

The config's `layer_types` says which layers mix tokens how:

- "linear_attention" (Gated DeltaNet): packed q, k, v, z and b, a projections; a
  depthwise causal convolution (with SiLU) over q, k, v; L2-normalised q and k; the
  gated delta rule (kiln.ops.gated_delta_rule) with decay g = -exp(A_log) *
  softplus(a + dt_bias) and beta = sigmoid(b); an RMSNorm gated by SiLU(z); out_proj.
  Its cache is a fixed-size recurrent state and the convolution's last inputs.
- "full_attention": grouped-query attention whose q_proj also yields an output gate
  (sigmoid), RMSNorms on q and k per head, RoPE on the first quarter of each head
  (partial rotary). Its cache is the contiguous KV cache.

Every layer's feed-forward part is a sparse MoE (top-k routed experts plus a shared
expert scaled by a sigmoid gate), or a dense SwiGLU MLP on `mlp_only_layers` and
layers off `decoder_sparse_step`. RMSNorms scale by (1 + weight). Module names mirror
Hugging Face's Qwen3NextForCausalLM, so a checkpoint's state dict loads as is.

    forward(tokens [B, T], input_pos [B, T] or [T], block_table=None, logits_at=None,
            seq_lens [B] | None) -> logits [B, T, vocab]

Row b holds T new tokens of sequence b at input_pos[b]; a row whose first position is
0 starts a new sequence (its linear-attention state starts at zero). seq_lens says how
many of a row's T tokens are real: the rest are right padding, which attention
ignores and which must not advance the recurrent state, so the linear layers give
them no decay and no update (beta = 0) and keep the convolution inputs of the last
real token.

The MoE routes as Hugging Face's Qwen3NextSparseMoeBlock does (softmax over every
expert, the top k, renormalised with norm_topk_prob) and runs the chosen experts in
one of kiln.models.moe's static-shape forms: "grouped" (kiln.ops.moe_experts: the
pairs sorted by expert, each expert once over its rows) for prefill and decode
batches over 4, "gathered" (only the chosen experts' weights read) for smaller decode
steps, "dense" (every expert on every token) as a reference. The routed experts'
weights are stacked per layer ([n_experts, ...] tensors); the loader (hf.py) fills
each slot from the checkpoint's per-expert tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln.ops
from kiln.errors import ArgumentError, CheckpointError
from kiln.models.kv_cache import ContiguousKVCache, LinearAttentionState
from kiln.models.llama import attention_mask, rotate_half
from kiln.models.moe import Experts, RoutedMoE, set_decode_batch, use_expert_form

LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' Qwen3NextConfig defaults for the keys a config.json may leave out (or
# null): transformers builds the checkpoint's model from them, so kiln must too; its own
# Llama-style fallbacks had built another model (num_experts_per_tok 1 for 10 routed
# each token to fewer experts without a word; head_dim hidden / heads for 256 refused
# the checkpoint's tensors)
HF_DEFAULTS = {"num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
               "num_experts_per_tok": 10, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512}


@dataclass
class Qwen3NextConfig:
    vocab_size: int
    dim: int
    n_layers: int
    layer_types: tuple[str, ...]
    # full attention
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    # linear attention (gated delta rule)
    linear_k_heads: int = 16
    linear_v_heads: int = 32
    linear_k_dim: int = 128
    linear_v_dim: int = 128
    conv_kernel: int = 4
    # feed-forward
    intermediate_size: int = 5632  # dense MLP layers
    n_experts: int = 0
    experts_per_token: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    tie_word_embeddings: bool = False

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe(self, layer: int) -> bool:
        return (self.n_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, hf: dict, max_seq_len: int, where: str = "config.json"):
        """From a Hugging Face config.json (dict) whose model_type is qwen3_next."""
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"hidden_act {act!r} is not supported", where=where,
                                  hint="Qwen3-Next uses SiLU")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise CheckpointError(f"RoPE type {kind!r} is not supported for Qwen3-Next",
                                  where=where, hint="kiln runs its default RoPE")

        def opt(key):
            return HF_DEFAULTS[key] if hf.get(key) is None else hf[key]

        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rotary = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
        eps = hf.get("rms_norm_eps", 1e-6)
        for key, v, ok, want in (("rope_theta", theta, lambda x: x > 0, "a positive number"),
                                 ("partial_rotary_factor", rotary, lambda x: 0 <= x <= 1,
                                  "a number in [0, 1]"),
                                 ("rms_norm_eps", eps, lambda x: x >= 0, "a number >= 0")):
            if not isinstance(v, int | float) or isinstance(v, bool) or not ok(v):
                raise CheckpointError(f"config.json's {key} is {v!r}, not {want}", where=where)
        mlp_only = hf.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in mlp_only):
            raise CheckpointError(f"config.json's mlp_only_layers is {mlp_only!r}, not a list "
                                  "of layer indices", where=where)
        try:
            n = hf["num_hidden_layers"]
            types = hf.get("layer_types") or [
                "full_attention" if (i + 1) % hf.get("full_attention_interval", 4) == 0
                else "linear_attention" for i in range(n)]
            bad = sorted(set(types) - set(LAYER_TYPES))
            if bad or len(types) != n:
                raise CheckpointError(f"layer_types {types} is not {n} entries of "
                                      f"{', '.join(LAYER_TYPES)}", where=where)
            cfg = cls(
                vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=n,
                layer_types=tuple(types),
                n_heads=hf["num_attention_heads"],
                n_kv_heads=opt("num_key_value_heads"), head_dim=opt("head_dim"),
                rope_theta=float(theta), partial_rotary_factor=rotary,
                attention_bias=bool(hf.get("attention_bias", False)),
                linear_k_heads=hf["linear_num_key_heads"],
                linear_v_heads=hf["linear_num_value_heads"],
                linear_k_dim=hf["linear_key_head_dim"],
                linear_v_dim=hf["linear_value_head_dim"],
                conv_kernel=hf.get("linear_conv_kernel_dim", 4),
                intermediate_size=hf["intermediate_size"],
                n_experts=opt("num_experts"), experts_per_token=opt("num_experts_per_tok"),
                moe_intermediate_size=opt("moe_intermediate_size"),
                shared_expert_intermediate_size=opt("shared_expert_intermediate_size"),
                norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                decoder_sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(mlp_only), norm_eps=eps,
                max_seq_len=max_seq_len,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks {e.args[0]!r}", where=where) from None
        cfg.check_heads_and_experts(where)
        return cfg

    def check_heads_and_experts(self, where: str) -> None:
        """What transformers leaves to fail in its forward (a view, a topk), said at load."""
        for what, n, of in (("linear_num_value_heads", self.linear_v_heads,
                             ("linear_num_key_heads", self.linear_k_heads)),
                            ("num_attention_heads", self.n_heads,
                             ("num_key_value_heads", self.n_kv_heads))):
            if n % of[1]:
                raise CheckpointError(f"{what} {n} is not a multiple of {of[0]} {of[1]}",
                                      where=where, hint="each key head serves a whole "
                                      "number of query / value heads")
        if self.n_experts and self.experts_per_token > self.n_experts:
            raise CheckpointError(f"num_experts_per_tok {self.experts_per_token} exceeds "
                                  f"num_experts {self.n_experts}", where=where,
                                  hint="a token is routed to k of the experts")


def rope_tables(cfg: Qwen3NextConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq_len, rotary_dim] for the rotated part of each head."""
    d = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                      device=device) / d))
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    emb = torch.outer(t, inv_freq).repeat(1, 2)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] dims of x [B, T, H, D]; the rest pass through."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Qwen3-Next's RMSNorm: the weight is an offset from 1, applied in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the linear attention's output, then times SiLU(z)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """HF's `linear_attn`: token mixing by the gated delta rule."""

    def __init__(self, cfg: Qwen3NextConfig):
        super().__init__()
        self.cfg = cfg
        hk, hv, dk, dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
        self.key_dim, self.value_dim = hk * dk, hv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkvz = nn.Linear(cfg.dim, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.dim, 2 * hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, cfg.conv_kernel, bias=False,
                                groups=self.conv_dim)  # holds the weight; forward below
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(dv, cfg.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.dim, bias=False)
        self.state: LinearAttentionState | None = None

    def tensor_parallel_seeds(self) -> dict:
        """Tensor parallelism cuts this layer by heads (kiln.compile's parallel=); the
        recurrent and convolution state are read before the ops that decide their cut
        write them, so they are cut up front: by value heads, and per segment of the
        convolution's [q, k, v] channels."""
        return {"state.recurrent": 1,
                "state.conv": (2, (self.key_dim, self.key_dim, self.value_dim))}

    def split_projections(self, x):
        """q, k [B, T, Hk * Dk], v [B, T, Hv * Dv], z [B, T, Hv, Dv], b, a [B, T, Hv].

        The projections are packed per key head: [q, k, v, z] of that head's group,
        then [b, a] of the group's value heads.
        """
        B, T, _ = x.shape
        c = self.cfg
        group = c.linear_v_heads // c.linear_k_heads
        qkvz = self.in_proj_qkvz(x).view(B, T, c.linear_k_heads, -1)
        q, k, v, z = qkvz.split([c.linear_k_dim, c.linear_k_dim, group * c.linear_v_dim,
                                 group * c.linear_v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, c.linear_k_heads, 2 * group).split(group, dim=-1)
        return (q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1),
                z.reshape(B, T, c.linear_v_heads, c.linear_v_dim),
                b.reshape(B, T, -1), a.reshape(B, T, -1))

    def causal_conv(self, x, past, seq_lens):
        """Depthwise causal convolution of x [B, T, C] after `past` [B, kernel - 1, C];
        (SiLU of it, the kernel - 1 inputs before each row's next token)."""
        T, n = x.shape[1], self.cfg.conv_kernel
        window = torch.cat([past.to(x.dtype), x], dim=1)  # [B, n - 1 + T, C]
        w = self.conv1d.weight[:, 0]  # [C, n]
        out = window[:, 0:T] * w[:, 0]
        for j in range(1, n):
            out = out + window[:, j:j + T] * w[:, j]
        if seq_lens is None:
            kept = window[:, T:]
        else:  # the inputs just before each row's first padding token
            idx = seq_lens[:, None] + torch.arange(n - 1, device=x.device)
            kept = window.gather(1, idx[:, :, None].expand(-1, -1, window.shape[-1]))
        return F.silu(out), kept

    def forward(self, x, input_pos, seq_lens):
        B, T, _ = x.shape
        c = self.cfg
        q, k, v, z, b, a = self.split_projections(x)
        if self.state is not None:
            past_conv, state = self.state.read(input_pos)
        else:
            past_conv = x.new_zeros(B, c.conv_kernel - 1, self.conv_dim)
            state = None
        mixed, conv_state = self.causal_conv(torch.cat([q, k, v], dim=-1), past_conv, seq_lens)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = l2norm(q.reshape(B, T, c.linear_k_heads, c.linear_k_dim).float())
        k = l2norm(k.reshape(B, T, c.linear_k_heads, c.linear_k_dim).float())
        v = v.reshape(B, T, c.linear_v_heads, c.linear_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if seq_lens is not None:  # padding leaves the state as it is
            real = torch.arange(T, device=x.device)[None, :, None] < seq_lens[:, None, None]
            beta, g = torch.where(real, beta, 0), torch.where(real, g, 0)
        o, new_state = kiln.ops.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                 output_final_state=True)
        if self.state is not None:
            self.state.write(conv_state, new_state)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(B, T, self.value_dim))


class Attention(nn.Module):
    """HF's `self_attn`: gated grouped-query attention with q/k norms, partial RoPE."""

    def __init__(self, cfg: Qwen3NextConfig):
        super().__init__()
        self.cfg = cfg
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd * 2, bias=bias)  # query and gate
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.norm_eps)
        self.k_norm = RMSNorm(hd, cfg.norm_eps)
        self.kv_cache: ContiguousKVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        B, T, _ = x.shape
        c = self.cfg
        q, gate = self.q_proj(x).view(B, T, c.n_heads, 2 * c.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim))
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        q, k = apply_partial_rope(q, cos, sin), apply_partial_rope(k, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(RoutedMoE):
    """HF's Qwen3NextSparseMoeBlock: top-k routed experts (forms: see the top) plus a
    shared expert scaled by a sigmoid gate."""

    def __init__(self, cfg: Qwen3NextConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)  # the router
        self.experts = Experts(cfg.n_experts, cfg.moe_intermediate_size, cfg.dim)
        self.shared_expert = MLP(cfg.dim, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.dim, 1, bias=False)

    def tensor_parallel_seeds(self) -> dict:
        """The router and the shared expert's gate score whole rows: whole on every rank."""
        return {"gate.weight": None, "shared_expert_gate.weight": None}

    def routing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (weights [N, k] fp32, expert ids [N, k]): softmax in fp32 over
        the router's logits (in x's dtype), the top k, renormalised to sum 1 with
        norm_topk_prob, then rounded to x's dtype as the reference does."""
        c = self.cfg
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(c.experts_per_token, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype).float(), ids

    def forward(self, x):
        B, T, D = x.shape
        flat = x.reshape(B * T, D)
        weights, ids = self.routing(flat)
        scale = torch.sigmoid(self.shared_expert_gate(flat))
        if self._shared_is_an_expert(B, T):  # [B, T] rows: the residual add joins its kernel
            return self.experts.gathered(x, weights.view(B, T, -1), ids.view(B, T, -1),
                                         shared=(self.shared_expert, scale.view(B, T, 1)))
        routed = self.run_experts(flat, weights, ids, B, T)
        return (routed + scale * self.shared_expert(flat)).view(B, T, D)

    def _shared_is_an_expert(self, B, T) -> bool:
        """Does the shared expert run as one more gathered expert (decode; its widths
        the routed experts': Qwen3-Next-80B's 512 both)? Its two GEMVs cost two
        launches a layer for a few MB of weights."""
        mlp, experts = self.shared_expert, self.experts
        return (isinstance(experts, Experts) and self.form_for(B, T) == "gathered"
                and mlp.gate_proj.weight.shape == experts.gate_proj.shape[1:]
                and mlp.down_proj.weight.shape == experts.down_proj.shape[1:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, layer: int):
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe(layer) else MLP(cfg.dim, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, input_pos, seq_lens):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, input_pos, seq_lens)
        else:
            h = self.self_attn(h, cos, sin, mask, input_pos)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    """HF's `model.`: embeddings, layers, final norm."""

    def __init__(self, cfg: Qwen3NextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Qwen3Next(nn.Module):
    # A right-padded prefill must say where each row's tokens end (seq_lens).
    needs_seq_lens = True

    def __init__(self, cfg: Qwen3NextConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rope(self, device) -> None:
        """(Re)compute the RoPE tables on `device`: after building on the meta device."""
        self.rope_cos, self.rope_sin = rope_tables(self.cfg, device)

    def use_forms(self, experts: str = "auto") -> None:
        """Run every MoE layer's experts in one form (tests compare them): "grouped" |
        "gathered" | "dense" | "auto"."""
        use_expert_form(self, experts)

    @property
    def cache(self) -> ContiguousKVCache | None:
        """The first attention layer's KV cache (all layers have one after setup_cache)."""
        for layer in self.model.layers:
            if layer.layer_type == "full_attention":
                return layer.self_attn.kv_cache
        return None

    def setup_cache(self, dtype: torch.dtype | None = None, *, max_batch_size: int = 1,
                    paged: bool = False, **_paged_options) -> None:
        """A KV cache for each attention layer, a state for each linear one; the MoE
        layers learn the most rows a decode step can route (their form depends on it)."""
        if paged:
            raise ArgumentError("Qwen3-Next runs with the contiguous cache only",
                                hint="load it with paged=False: its linear-attention "
                                "state is kept per cache row")
        dtype = dtype or self.lm_head.weight.dtype
        device = self.lm_head.weight.device
        c = self.cfg
        set_decode_batch(self, max_batch_size)
        for layer in self.model.layers:
            if layer.layer_type == "full_attention":
                layer.self_attn.kv_cache = ContiguousKVCache(c, max_batch_size, dtype).to(device)
            else:
                attn = layer.linear_attn
                state = LinearAttentionState(
                    max_batch_size, attn.conv_dim, c.conv_kernel,
                    (c.linear_v_heads, c.linear_k_dim, c.linear_v_dim), dtype)
                attn.state = state.to(device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                block_table: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None,
                seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; or [B, L, vocab] at `logits_at` ([B, L] indices into T).
        seq_lens [B]: real tokens per row (the rest right padding); default all T."""
        if block_table is not None:
            raise ArgumentError("Qwen3-Next has no paged cache: block_table must be None")
        B, T = tokens.shape
        input_pos = input_pos.expand(B, T)
        x = self.model.embed_tokens(tokens)
        cos = self.rope_cos[input_pos][:, :, None, :].to(x.dtype)
        sin = self.rope_sin[input_pos][:, :, None, :].to(x.dtype)
        cache = self.cache
        kv_pos = input_pos if cache is None else cache.positions(None, tokens.device)
        mask = attention_mask(input_pos, kv_pos, None)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, input_pos, seq_lens)
        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(self.model.norm(x))
