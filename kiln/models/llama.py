"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2) in one readable file.

gpt-fast's shape: a decoder with grouped-query attention, RoPE, RMSNorm, SwiGLU and a
static KV cache written with index_copy_. Module names mirror Hugging Face's
(model.layers.N.self_attn.q_proj, ...) so a checkpoint's state dict loads as is.
The config decides the variant: qkv bias (Qwen2), tied embeddings, Llama 3.1 RoPE
scaling.

forward(tokens [B, T], input_pos [T]) -> logits [B, T, vocab]: the T new tokens sit at
positions input_pos; attention sees every cached position <= its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


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
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": 8.0, ...}
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    max_batch_size: int = 1
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_heads


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        intermediate_size=176, max_seq_len=128, rope_theta=10000.0),
    "llama2-7b": LlamaConfig(),
    "llama3-8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32,
                             n_kv_heads=8, intermediate_size=14336, rope_theta=500000.0,
                             max_seq_len=8192),
    "llama2-70b": LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64,
                              n_kv_heads=8, intermediate_size=28672, max_seq_len=4096),
}


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    s = cfg.rope_scaling or {}
    if s.get("rope_type", s.get("type")) == "llama3":
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
    return inv_freq.float()


def rope_tables(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, [max_seq_len, head_dim] (halves repeated, HF layout)."""
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [T, D]."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class KVCache(nn.Module):
    """A contiguous static cache [B, n_kv_heads, max_seq_len, head_dim], updated in place."""

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype):
        super().__init__()
        shape = (cfg.max_batch_size, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def update(self, input_pos, k, v):
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        hd, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)
        self.kv_cache: KVCache | None = None

    def forward(self, x, cos, sin, mask, input_pos):
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, cfg.n_heads * cfg.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, cos, sin, mask, input_pos):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class Body(nn.Module):
    """HF's `model.`: embeddings, layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def setup_cache(self, dtype: torch.dtype | None = None) -> None:
        """Give every layer a static KV cache (needed before decoding)."""
        dtype = dtype or self.lm_head.weight.dtype
        device = self.lm_head.weight.device
        for layer in self.model.layers:
            layer.self_attn.kv_cache = KVCache(self.cfg, dtype).to(device)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        cos = self.rope_cos[input_pos].to(x.dtype)
        sin = self.rope_sin[input_pos].to(x.dtype)
        if self.model.layers[0].self_attn.kv_cache is not None:
            span = torch.arange(self.cfg.max_seq_len, device=tokens.device)
        else:
            span = input_pos
        mask = span[None, :] <= input_pos[:, None]
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.lm_head(self.model.norm(x))


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Llama:
    """The built-in tiny Llama with random weights and a KV cache, for tests and demos."""
    cfg = LlamaConfig(**{**PRESETS["tiny"].__dict__, **overrides})
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model = model.to(dtype).eval()
    model.setup_cache(dtype)
    return model


def example_inputs(cfg: LlamaConfig, seq_len: int = 8, batch: int = 1):
    """Example args and dynamic shapes for a prefill of `seq_len` tokens from position 0."""
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len))
    input_pos = torch.arange(seq_len)
    T = torch.export.Dim("seq", min=1, max=cfg.max_seq_len)
    return (tokens, input_pos), ({1: T}, {0: T})
