"""A decoder written the way gpt-fast writes one, with no thought of kiln: q, k and v
from one fused projection and gate/up from another, split apart in forward; a static
KV cache [B, KV, S, D] written with index_copy_; RoPE on complex-free cos/sin tables."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class KVCache(nn.Module):
    def __init__(self, batch, heads, max_len, head_dim):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, heads, max_len, head_dim))
        self.register_buffer("v_cache", torch.zeros(batch, heads, max_len, head_dim))

    def update(self, input_pos, k, v):
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads, ffn, max_len):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w13 = nn.Linear(dim, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)
        self.attn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.cache = KVCache(1, kv_heads, max_len, self.head_dim)

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, d = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.wqkv(self.attn_norm(x)).split([d, kv, kv], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = self.cache.update(input_pos, k, v)
        rep = self.heads // self.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.wo(y.transpose(1, 2).contiguous().view(b, t, d))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class GptFast(nn.Module):
    def __init__(self, vocab=128, dim=64, layers=2, heads=4, kv_heads=2, ffn=96, max_len=32):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads, ffn, max_len)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        freqs = 1.0 / (10000 ** (torch.arange(half).float() / half))
        angles = torch.outer(torch.arange(max_len).float(), freqs)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def forward(self, idx, input_pos):
        mask = self.causal[None, None, input_pos]
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))


def gpt_fast(seed=0, **kw) -> GptFast:
    torch.manual_seed(seed)
    m = GptFast(**kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1) if p.dim() > 1 else p.normal_(1.0, 0.1)
    return m.eval()
