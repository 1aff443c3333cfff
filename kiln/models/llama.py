"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2) in one readable file.

gpt-fast's shape: a decoder with grouped-query attention, RoPE, RMSNorm and SwiGLU,
with a KV cache updated in place. Module names mirror Hugging Face's
(model.layers.N.self_attn.q_proj, ...) so a checkpoint's state dict loads as is.
The config decides the variant: biases (Qwen2's q/k/v), tied embeddings, Llama 3.1
RoPE scaling, a sliding attention window (Mistral, Qwen2).

    forward(tokens [B, T], input_pos [B, T] or [T], block_table [B, blocks] | None)
        -> logits [B, T, vocab]

Row b holds T new tokens of sequence b at positions input_pos[b] (a [T] input_pos is
shared by every row); each attends to its own sequence's cached positions <= its
own. Without a cache (no setup_cache) the T tokens attend only to each other. The
cache kinds live in kv_cache.py: the contiguous one keeps batch row b in cache row
b; the paged one finds the sequence's blocks through `block_table`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.models.kv_cache import ContiguousKVCache, PagedKVCache


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    intermediate_size: int = 11008
    head_dim: int | None = None  # defaults to dim // n_heads
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", "factor": ...}
    norm_eps: float = 1e-5
    max_seq_len: int = 2048  # positions the RoPE tables and the KV cache cover
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets this and o_bias
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before RoPE
    o_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # a query sees the last `sliding_window` positions
    sliding_layers: tuple[int, ...] | None = None  # layers with the window (None: all)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads

    def window(self, layer: int) -> int | None:
        if self.sliding_layers is None or layer in self.sliding_layers:
            return self.sliding_window
        return None

    def with_(self, **changes) -> LlamaConfig:
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise KilnError(f"LlamaConfig has no field(s) {bad}", hint=f"fields: {sorted(known)}")
        return replace(self, **changes)


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        intermediate_size=176, max_seq_len=128, rope_theta=10000.0),
    "llama2-7b": LlamaConfig(max_seq_len=4096),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
                             max_seq_len=8192),
    "llama3.1-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                               n_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
                               max_seq_len=8192,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 8192}),
    "llama2-70b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64,
                              n_kv_heads=8, intermediate_size=28672, max_seq_len=4096),
}

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """The inverse frequencies, computed in fp32 exactly as Meta's and HF's code do."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / s["factor"]
    elif kind == "llama3":
        factor = s["factor"]
        low, high = s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_len = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`; short ones kept; the band between blends.
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    elif kind != "default":
        raise KilnError(f"RoPE scaling {kind!r} is not supported",
                        hint=f"supported: {', '.join(ROPE_TYPES)}")
    return inv_freq


def rope_tables(cfg: LlamaConfig, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_seq_len, head_dim] (halves repeated, HF layout)."""
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, rope_inv_freq(cfg).to(device))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; cos/sin [B, T, 1, D]."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


def attention_mask(input_pos: torch.Tensor, kv_pos: torch.Tensor,
                   window: int | None) -> torch.Tensor:
    """[B, 1, T, S]: the query at input_pos[b, t] sees key kv_pos[b, s] when it is not later
    (and, with a window, fewer than `window` positions earlier). kv_pos is [B or 1, S]."""
    q, k = input_pos[:, None, :, None], kv_pos[:, None, None, :]
    mask = k <= q
    if window is not None:
        mask = mask & (k > q - window)
    return mask


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, window: int | None):
        super().__init__()
        self.cfg, self.window = cfg, window
        hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.norm_eps), RMSNorm(hd, cfg.norm_eps)
        self.kv_cache: ContiguousKVCache | PagedKVCache | None = None

    def forward(self, x, cos, sin, masks, input_pos, block_table):
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:  # k, v become the sequence's whole cache [B, S, KV, D]
            k, v = self.kv_cache.update(input_pos, k, v, block_table)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=masks[self.window],
                                           enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, cfg.window(layer))
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, masks, input_pos, block_table):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, masks, input_pos, block_table)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """HF's `model.`: embeddings, layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
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

    @property
    def cache(self) -> ContiguousKVCache | PagedKVCache | None:
        return self.model.layers[0].self_attn.kv_cache

    def setup_cache(self, dtype: torch.dtype | None = None, *, max_batch_size: int = 1,
                    paged: bool = False, block_size: int = 16,
                    num_blocks: int | None = None) -> None:
        """Give every layer a KV cache (needed before decoding); see kv_cache.py."""
        dtype = dtype or self.lm_head.weight.dtype
        device = self.lm_head.weight.device
        for layer in self.model.layers:
            if paged:
                cache = PagedKVCache(self.cfg, max_batch_size, block_size, num_blocks, dtype)
            else:
                cache = ContiguousKVCache(self.cfg, max_batch_size, dtype)
            layer.self_attn.kv_cache = cache.to(device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor,
                block_table: torch.Tensor | None = None,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; or [B, L, vocab] at `logits_at` ([B, L] indices into T).

        Generation needs only each prompt's last position: computing the head there alone
        saves T x vocab logits per row (0.5 GB for 2048 tokens of Llama 3 in fp16).
        """
        B, T = tokens.shape
        input_pos = input_pos.expand(B, T)
        x = self.model.embed_tokens(tokens)
        cos = self.rope_cos[input_pos][:, :, None, :].to(x.dtype)
        sin = self.rope_sin[input_pos][:, :, None, :].to(x.dtype)
        cache = self.cache
        kv_pos = input_pos if cache is None else cache.positions(block_table, tokens.device)
        windows = {layer.self_attn.window for layer in self.model.layers}
        masks = {w: attention_mask(input_pos, kv_pos, w) for w in windows}
        for layer in self.model.layers:
            x = layer(x, cos, sin, masks, input_pos, block_table)
        if logits_at is not None:
            x = x.gather(1, logits_at[:, :, None].expand(-1, -1, x.shape[-1]))
        return self.lm_head(self.model.norm(x))


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Llama:
    """The built-in tiny Llama with random weights and a KV cache, for tests and demos."""
    cfg = PRESETS["tiny"].with_(**overrides)
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(dtype).eval()
    model.setup_cache(dtype=dtype)
    return model


def example_inputs(cfg: LlamaConfig, seq_len: int = 8, batch: int = 1):
    """Example args and dynamic shapes for a prefill of `seq_len` tokens from position 0."""
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    input_pos = torch.arange(seq_len)
    T = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    return (tokens, input_pos), ({1: T}, {0: T})
