"""The model `kiln bench` measures: a Llama written the way gpt-fast writes one.

Nothing in it is shaped for kiln: q, k, v come from one fused projection and gate/up
from another, split apart in forward (`split`, `chunk`); the KV cache is a static
[B, KV heads, S, D] buffer written with `index_copy_`; attention is SDPA over the whole
cache with an explicit boolean causal mask sliced from a buffer; GQA repeats the KV
heads. A speed figure on this model says what a user's own model gets.

`quantize_fp8` gives the same model with kiln's block-scaled fp8 projections, made
the way quantize="fp8" makes kiln.models' Llama (kiln.ops.quantize_weight once, then
kiln.ops.fp8_linear in forward; `Fp8Linear` here is what a user of kiln.ops writes,
kiln.models' own being out of a public user's reach): the fp8 rows of
`kiln bench --quantize fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln.ops


@dataclass(frozen=True)
class Shape:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_len: int

    def with_(self, **changes) -> Shape:
        return replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


PRESETS = {
    "tiny": Shape(vocab=256, dim=64, layers=2, heads=4, kv_heads=2, ffn=176, max_len=96),
    "llama3-8b": Shape(vocab=128256, dim=4096, layers=32, heads=32, kv_heads=8,
                       ffn=14336, max_len=2304),
}


class Block(nn.Module):
    def __init__(self, s: Shape, batch: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.wqkv = nn.Linear(s.dim, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=False)
        self.wo = nn.Linear(s.dim, s.dim, bias=False)
        self.w13 = nn.Linear(s.dim, 2 * s.ffn, bias=False)
        self.w2 = nn.Linear(s.ffn, s.dim, bias=False)
        self.attn_norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(s.dim, eps=1e-5)
        cache = (batch, s.kv_heads, s.max_len, s.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache), persistent=False)

    def forward(self, x, cos, sin, mask, input_pos):
        b, t, d = x.shape
        kv = self.kv_heads * self.head_dim
        q, k, v = self.wqkv(self.attn_norm(x)).split([d, kv, kv], dim=-1)
        q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        rep = self.heads // self.kv_heads
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        x = x + self.wo(y.transpose(1, 2).contiguous().view(b, t, d))
        gate, up = self.w13(self.ffn_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(gate) * up)


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Subject(nn.Module):
    """Tokens [B, T] and positions [T] -> logits [B, T, vocab]; the cache is batch B."""

    def __init__(self, s: Shape, batch: int = 1):
        super().__init__()
        self.shape, self.batch = s, batch
        self.tok_embeddings = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(Block(s, batch) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim, eps=1e-5)
        self.output = nn.Linear(s.dim, s.vocab, bias=False)
        half = s.head_dim // 2
        freqs = 1.0 / (500000.0 ** (torch.arange(half).float() / half))
        angles = torch.outer(torch.arange(s.max_len).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        causal = torch.tril(torch.ones(s.max_len, s.max_len, dtype=torch.bool))
        self.register_buffer("causal", causal, persistent=False)

    def forward(self, idx, input_pos):
        mask = self.causal[None, None, input_pos]
        cos, sin = self.cos[input_pos], self.sin[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        return self.output(self.norm(x))


def build(s: Shape, dtype: torch.dtype, device: str, seed: int = 0) -> Subject:
    """A batch-1 Subject with random weights (std 0.02; norms near 1) on `device`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Subject(s).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.02) if "norm" in name else p.normal_(0.0, 0.02)
    return model.eval()


FP8_PROJECTIONS = ("wqkv", "wo", "w13", "w2")


class Fp8Linear(nn.Module):
    """A bias-free linear whose weight is e4m3 with an fp32 scale per 128 x 128 block:
    kiln.ops.fp8_linear quantises the activations per token group and multiplies (kiln
    compiles it to its fp8 GEMM; eagerly, and on the CPU target, its PyTorch form)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale_inv, requires_grad=False)

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        return cls(*kiln.ops.quantize_weight(linear.weight.detach()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kiln.ops.fp8_linear(x, self.weight, self.weight_scale_inv)


def quantize_fp8(base: Subject) -> Subject:
    """A Subject whose block projections are `base`'s quantised to fp8 in 128 x 128
    blocks (Fp8Linear); embedding, norms and LM head shared with `base`, as fp8
    releases keep them in the model's dtype. Its KV cache is its own."""
    model = _shell(base, base.batch)
    with torch.no_grad():
        for layer, source in zip(model.layers, base.layers):
            for name in FP8_PROJECTIONS:
                setattr(layer, name, Fp8Linear.quantize(getattr(source, name)))
    return model.eval()


def with_batch(base: Subject, batch: int) -> Subject:
    """A Subject for `batch` sequences sharing `base`'s weights: only the cache is new."""
    if batch == base.batch:
        return base
    return _shell(base, batch).eval()


def _shell(base: Subject, batch: int) -> Subject:
    """A Subject of `batch` rows holding `base`'s parameters (fp8 projections as fp8)
    and buffers, with a new zero KV cache."""
    with torch.device("meta"):
        model = Subject(base.shape, batch)
    for name, m in base.named_modules():
        if isinstance(m, Fp8Linear):  # its parameters are assigned below
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, Fp8Linear(m.weight, m.weight_scale_inv))
    device, dtype = base.norm.weight.device, base.norm.weight.dtype
    for name, p in base.named_parameters():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, leaf, p)
    for name in ("cos", "sin", "causal"):
        setattr(model, name, getattr(base, name))
    for layer in model.layers:
        for name in ("k_cache", "v_cache"):
            setattr(layer, name, torch.zeros(layer.k_cache.shape, dtype=dtype, device=device))
    return model


def weight_bytes(model: Subject, batch: int) -> int:
    """Bytes of weights one decode step reads: all but the embedding table (B rows)."""
    emb = model.tok_embeddings.weight
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)
    return rest + batch * emb.shape[1] * emb.element_size()


def kv_bytes(s: Shape, batch: int, context: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache one decode step at `context` must read (keys and values)."""
    return 2 * s.layers * batch * context * s.kv_heads * s.head_dim * dtype.itemsize


def matmul_flops(s: Shape, batch: int, tokens: int) -> float:
    """Flops of a prefill of `tokens` per sequence: projections plus causal attention."""
    per_token = 2 * (s.dim * (s.heads + 2 * s.kv_heads) * s.head_dim + s.dim * s.dim
                     + 3 * s.dim * s.ffn) * s.layers + 2 * s.dim * s.vocab
    attention = 2 * 2 * s.layers * s.heads * s.head_dim * tokens * (tokens + 1) / 2
    return batch * (per_token * tokens + attention)
