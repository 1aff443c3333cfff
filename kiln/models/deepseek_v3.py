"""DeepSeek-V3 in one readable file: multi-head latent attention and a routed MoE.

    forward(tokens [B, T], input_pos [B, T] or [T], block_table [B, blocks] | None)
        -> logits [B, T, vocab]

Same calling convention as llama.py. What differs:

- Multi-head latent attention (MLA). Keys and values of all heads come from one
  compressed latent per token: c = norm(x @ W_DKV) [kv_lora_rank], plus one shared
  rotary key k_rope [qk_rope_head_dim]. The cache holds only these
  (kv_lora_rank + qk_rope_head_dim numbers per token per layer: 576 for V3, against
  2 * 128 * 192 for plain multi-head attention). kv_b_proj expands c into every head's
  k_nope and v. Queries go through their own low-rank pair (q_a_proj, q_b_proj) when
  q_lora_rank is set. The rope part is rotated in DeepSeek's interleaved pairs.
- Two forms of the same attention. Expanded (prefill): expand the cached latents to
  per-head keys and values, then ordinary attention. Absorbed (decode): since
  q_nope . (W_UK c) = (W_UK^T q_nope) . c, W_UK folds into the query and W_UV into the
  output, so attention runs over the latent cache itself as one-key-head attention
  with kv_lora_rank + qk_rope_head_dim wide keys; a decode step reads 576 numbers per
  cached token instead of expanding the whole cache. W_UK and W_UV are split out of
  kv_b_proj once, after loading (absorb_weights). A decode module (T = 1, known when
  traced) uses the absorbed form; a prefill (T dynamic) the expanded one.
- YaRN RoPE: stretched frequencies, cos/sin scaled by the attention factor, and the
  softmax scale multiplied by mscale(factor, mscale_all_dim)^2.
- Mixture of experts (moe.py) in every layer from first_k_dense_replace on; the
  first ones keep a dense SwiGLU MLP (every layer when it is n_layers or more). The
  multi-token-prediction layer is not built.

Module names mirror Hugging Face's except the routed experts, which are stacked per
layer ([n_experts, ...] tensors, see moe.py); the loader (deepseek_v3_checkpoint.py)
stacks the checkpoint's per-expert tensors. With fp8 weights (an fp8 checkpoint kept
fp8, or quantize="fp8") the projections are fp8.Fp8Linear, kv_b_proj included (the
expanded form runs it as an fp8 linear; W_UK and W_UV come from its dequantised
values); the routed experts are moe.Fp8Experts (kiln::moe_experts_fp8).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln.ops
from kiln.errors import KilnError, ShapeError
from kiln.models.kv_cache import ContiguousLatentCache, PagedLatentCache
from kiln.models.llama import MLP, RMSNorm, attention_mask
from kiln.models.moe import MLPSizes, MoE, set_decode_batch, use_expert_form

ROPE_TYPES = ("default", "yarn")


@dataclass
class DeepseekV3Config:
    vocab_size: int = 129280
    dim: int = 7168
    n_layers: int = 61
    n_heads: int = 128
    q_lora_rank: int | None = 1536  # None: one full q_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 18432  # the dense layers' MLP
    moe_intermediate_size: int = 2048  # each routed (and shared) expert
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    n_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    first_k_dense_replace: int = 3
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "yarn", "factor": ..., ...}
    rope_interleave: bool = True
    norm_eps: float = 1e-6
    max_seq_len: int = 4096
    attention_bias: bool = False  # q_a_proj, kv_a_proj_with_mqa and o_proj
    tie_word_embeddings: bool = False

    def __post_init__(self):
        def bad(what: str, hint: str | None = None):
            raise ShapeError(f"DeepSeek-V3 config: {what}", where="DeepseekV3Config",
                             hint=hint)

        sizes = ("vocab_size", "dim", "n_layers", "n_heads", "kv_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                 "n_experts_per_tok", "n_group", "topk_group", "max_seq_len")
        for name in sizes:
            if getattr(self, name) < 1:
                bad(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.qk_rope_head_dim % 2:
            bad(f"qk_rope_head_dim {self.qk_rope_head_dim} is odd",
                "rotary dimensions come in pairs")
        if self.n_routed_experts % self.n_group:
            bad(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group "
                f"{self.n_group}", "experts are split into n_group equal groups")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2:
            bad(f"{per_group} expert(s) per group; a group is scored by its top-2 experts",
                "use n_group <= n_routed_experts / 2")
        if self.topk_group > self.n_group:
            bad(f"topk_group {self.topk_group} exceeds n_group {self.n_group}")
        if self.n_experts_per_tok > self.topk_group * per_group:
            bad(f"num_experts_per_tok {self.n_experts_per_tok} exceeds the "
                f"{self.topk_group * per_group} experts of the {self.topk_group} kept groups")
        # n_layers or more: every layer dense, as transformers builds it (a checkpoint cut
        # to its first layers keeps its config's first_k_dense_replace)
        if self.first_k_dense_replace < 0:
            bad(f"first_k_dense_replace {self.first_k_dense_replace} is negative")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def with_(self, **changes) -> DeepseekV3Config:
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise KilnError(f"DeepseekV3Config has no field(s) {bad}",
                            hint=f"fields: {sorted(known)}")
        return replace(self, **changes)


# ---- RoPE -----------------------------------------------------------------------------


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_parameters(cfg: DeepseekV3Config) -> tuple[torch.Tensor, float, float]:
    """(inverse frequencies [qk_rope_head_dim / 2], cos/sin factor, softmax scale).

    YaRN keeps high frequencies (many turns within the original context), divides low
    ones by `factor`, and ramps linearly between, over the dimensions whose turn counts
    lie between beta_slow and beta_fast. The softmax scale grows by mscale_all_dim's
    mscale squared, the cos/sin by mscale / mscale_all_dim's ratio.
    """
    d = cfg.qk_rope_head_dim
    pos_freqs = cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    inv_freq = 1.0 / pos_freqs
    scale = cfg.qk_head_dim ** -0.5
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0, scale
    if kind != "yarn":
        raise KilnError(f"RoPE scaling {kind!r} is not supported for DeepSeek-V3",
                        hint=f"supported: {', '.join(ROPE_TYPES)}")
    missing = [k for k in ("factor", "original_max_position_embeddings") if s.get(k) is None]
    if missing:
        raise KilnError(f"YaRN RoPE scaling without {' or '.join(missing)}",
                        where="DeepseekV3Config.rope_scaling",
                        hint="YaRN stretches the original context by factor")
    factor = s["factor"]
    old_len = s["original_max_position_embeddings"]
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")
    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        attn_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                       if mscale and mscale_all else yarn_mscale(factor))
    if mscale_all:
        scale *= yarn_mscale(factor, mscale_all) ** 2

    def dim_of(turns: float) -> float:  # the dimension that turns `turns` times in old_len
        return d * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency, 0: divide it by factor
    inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep
    return inv_freq, float(attn_factor), scale


def rope_tables(cfg: DeepseekV3Config, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's angles, [max_seq_len, qk_rope_head_dim / 2]."""
    inv_freq, attn_factor, _ = rope_parameters(cfg)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(t, inv_freq.to(device))
    return angles.cos() * attn_factor, angles.sin() * attn_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """Rotate pairs of x [..., D] by cos/sin [..., D/2]: pairs (x0, x1), (x2, x3), ...
    when interleaved (DeepSeek's layout), else (x_i, x_{i+D/2}). The result has the
    halves layout either way, as HF's: queries and keys get the same permutation, so
    their dot products are unchanged."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ---- attention ------------------------------------------------------------------------


def absorbed_weights(kv_b: torch.Tensor, cfg: DeepseekV3Config
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [h, r, nope], W_UV [h, v, r]) of the heads whose kv_b_proj rows [h * (nope +
    v), r] are `kv_b`: all of them, or one rank's (kiln.models.rank_weights reads only
    those rows). Each is laid out with its product's K contiguous, as a linear layer's
    weight: decode reads them as GEMVs (the batch of heads times one token), which
    stream such rows as the linear layers' (W_UV is kv_b_proj's own rows; W_UK their
    transpose)."""
    w = kv_b.view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, kv_b.shape[-1])
    return (w[:, :cfg.qk_nope_head_dim].transpose(1, 2).contiguous(),
            w[:, cfg.qk_nope_head_dim:].contiguous())


class LatentAttention(nn.Module):
    """Multi-head latent attention; `form` picks "absorbed", "expanded" or "auto"
    (absorbed when the traced call has one token per row)."""

    def __init__(self, cfg: DeepseekV3Config, scale: float):
        super().__init__()
        self.cfg, self.scale, self.form = cfg, scale, "auto"
        H, r = cfg.n_heads, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.dim, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)  # not norm_eps, as HF
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, cfg.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(r, 1e-6)
        self.kv_b_proj = nn.Linear(r, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * cfg.v_head_dim, cfg.dim, bias=cfg.attention_bias)
        # kv_b_proj split per head, for the absorbed form: [H, r, nope] and [H, v, r].
        self.register_buffer("w_uk", torch.empty(H, r, cfg.qk_nope_head_dim), persistent=False)
        self.register_buffer("w_uv", torch.empty(H, cfg.v_head_dim, r), persistent=False)
        self.latent_cache: ContiguousLatentCache | PagedLatentCache | None = None

    def tensor_parallel_seeds(self) -> dict:
        """Tensor parallelism cuts MLA by heads (q_b / q, kv_b and o_proj follow from
        the heads; the latent cache stays whole: every head reads all of it). The down
        projections feed norms over their whole output: whole on every rank, as vLLM
        keeps them (their fp8 scales and biases too)."""
        whole = [m for m in ("q_a_proj", "kv_a_proj_with_mqa") if hasattr(self, m)]
        return {f"{m}.{name}": None for m in whole
                for name, _ in getattr(self, m).named_parameters()}

    @torch.no_grad()
    def absorb_weights(self) -> None:
        """Split kv_b_proj into W_UK and W_UV (call after its weights are loaded).

        A copy, laid out for decode's GEMVs (absorbed_weights): V3's is 34 MB per layer
        in bf16, 0.15% of the model; the expanded form could use it too and free
        kv_b_proj later. An fp8
        kv_b_proj (fp8.Fp8Linear) is dequantised for it, one layer at a time, into the
        model's dtype (its norms'): the einsums are not fp8 GEMMs."""
        w = self.kv_b_proj.weight
        if w.dtype == torch.float8_e4m3fn:
            w = kiln.ops.dequantize_weight(w, self.kv_b_proj.weight_scale_inv)
        self.w_uk, self.w_uv = absorbed_weights(w.to(self.kv_a_layernorm.weight.dtype),
                                                self.cfg)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x, cos, sin, mask, input_pos, block_table):
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.queries(x).view(B, T, cfg.n_heads, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim],
                                                     dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
        k_rope = apply_rope(k_rope, cos[:, :, 0], sin[:, :, 0], cfg.rope_interleave)
        latent = torch.cat((self.kv_a_layernorm(c), k_rope), dim=-1)  # [B, T, latent_dim]
        # Under torch.export a dynamic T is a SymInt: only a decode module's T is an int.
        absorbed = self.form == "absorbed" or (self.form == "auto" and isinstance(T, int)
                                               and T == 1)
        if absorbed:  # reads the cache in place, as kiln.ops.latent_attention's layout
            y = self.absorbed(q_nope, q_rope, latent, input_pos, block_table)
        else:
            if self.latent_cache is not None:  # the sequence's whole cache [B, S, latent_dim]
                latent = self.latent_cache.update(input_pos, latent, block_table)
            y = self.expanded(q_nope, q_rope, latent, mask)  # [B, T, H, v_head_dim]
        return self.o_proj(y.reshape(B, T, cfg.n_heads * cfg.v_head_dim))

    def expanded(self, q_nope, q_rope, latent, mask):
        """Per-head keys and values from every cached latent: prefill's form. It expands
        all S cache rows (max_seq_len, or the block table's width), masked after."""
        cfg = self.cfg
        B, S, _ = latent.shape
        c, k_rope = latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).view(B, S, cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim)
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope[:, :, None, :].expand(-1, -1, cfg.n_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask, scale=self.scale)
        return y.transpose(1, 2)

    def absorbed(self, q_nope, q_rope, latent, input_pos, block_table):
        """Attention over the latents themselves: decode's form.

        score(t, s) = q_nope . W_UK c_s + q_rope . k_rope_s = [W_UK^T q_nope, q_rope] .
        latent_s, so every head attends to the same one-head keys (the latents) and
        values (their c part): one kiln.ops.latent_attention over the cache as it is
        stored; W_UV then maps each head's weighted c to its value space.
        """
        cfg = self.cfg
        r = cfg.kv_lora_rank
        q_latent = torch.einsum("bthn,hrn->bthr", q_nope, self.w_uk)
        if self.latent_cache is None:  # the call's own tokens are the whole sequence
            cache, table, pos = latent, None, input_pos - input_pos[:, :1]
        else:
            self.latent_cache.write(input_pos, latent, block_table)
            cache, table, pos = self.latent_cache.rows(), block_table, input_pos
        y = kiln.ops.latent_attention(q_latent, q_rope, cache[..., :r], cache[..., r:], pos,
                                      self.scale, table)  # [B, T, H, r]
        return torch.einsum("bthr,hvr->bthv", y, self.w_uv)


# ---- the model ------------------------------------------------------------------------


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, layer: int, scale: float):
        super().__init__()
        self.self_attn = LatentAttention(cfg, scale)
        if layer < cfg.first_k_dense_replace:
            self.mlp = MLP(MLPSizes(cfg.dim, cfg.intermediate_size))
        else:
            self.mlp = MoE(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, input_pos, block_table):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos, block_table)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """HF's `model.`: embeddings, layers, final norm."""

    def __init__(self, cfg: DeepseekV3Config, scale: float):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, scale) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class DeepseekV3(nn.Module):
    def __init__(self, cfg: DeepseekV3Config):
        super().__init__()
        self.cfg = cfg
        _, _, scale = rope_parameters(cfg)
        self.model = Body(cfg, scale)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.tie_weights()
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def finish_loading(self, device) -> None:
        """RoPE tables on `device` and the absorbed attention weights: after the weights
        are in place (built on the meta device, then loaded)."""
        self.init_rope(device)
        self.absorb_weights()

    def init_rope(self, device) -> None:
        """(Re)compute the RoPE tables on `device`: after building on the meta device."""
        self.rope_cos, self.rope_sin = rope_tables(self.cfg, device)

    def absorb_weights(self) -> None:
        """Every layer's W_UK and W_UV from its kv_b_proj (again after quantising it)."""
        for layer in self.model.layers:
            layer.self_attn.absorb_weights()

    def use_forms(self, attention: str = "auto", experts: str = "auto") -> None:
        """Force a form everywhere (tests compare them): attention "absorbed" |
        "expanded" | "auto", experts "grouped" | "gathered" | "dense" | "auto"."""
        if attention not in ("auto", "absorbed", "expanded"):
            raise KilnError(f"unknown attention form {attention!r}",
                            hint="auto, absorbed or expanded")
        use_expert_form(self, experts)
        for layer in self.model.layers:
            layer.self_attn.form = attention

    @property
    def cache(self) -> ContiguousLatentCache | PagedLatentCache | None:
        return self.model.layers[0].self_attn.latent_cache

    def setup_cache(self, dtype: torch.dtype | None = None, *, max_batch_size: int = 1,
                    paged: bool = False, block_size: int = 16,
                    num_blocks: int | None = None) -> None:
        """Give every layer a latent cache (needed before decoding); see kv_cache.py. The
        MoE layers learn the most rows a decode step can route (their form depends on it)."""
        dtype = dtype or self.lm_head.weight.dtype
        device = self.lm_head.weight.device
        cfg = self.cfg
        set_decode_batch(self, max_batch_size)
        for layer in self.model.layers:
            if paged:
                cache = PagedLatentCache(cfg.max_seq_len, cfg.latent_dim, max_batch_size,
                                         block_size, num_blocks, dtype)
            else:
                cache = ContiguousLatentCache(cfg.max_seq_len, cfg.latent_dim, max_batch_size,
                                              dtype)
            layer.self_attn.latent_cache = cache.to(device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                block_table: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; or [B, L, vocab] at `logits_at` ([B, L] indices into T)."""
        B, T = tokens.shape
        input_pos = input_pos.expand(B, T)
        x = self.model.embed_tokens(tokens)
        cos = self.rope_cos[input_pos][:, :, None, :].to(x.dtype)
        sin = self.rope_sin[input_pos][:, :, None, :].to(x.dtype)
        cache = self.cache
        kv_pos = input_pos if cache is None else cache.positions(block_table, tokens.device)
        mask = attention_mask(input_pos, kv_pos, None)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, input_pos, block_table)
        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(self.model.norm(x))
