"""Probe: what an explicit causal mask costs kiln's prefill attention (issue 10: prefill
2048 wants 0.90x torch.compile; attention is ~1/6 of the step).

gpt-fast's attention reads a boolean mask row per query, sliced from a [S, S] buffer by
the input positions, over the whole static cache; kiln bounds the key loop by the mask's
envelope and still loads the mask tile every step. The same attention written with
`is_causal=True` over the exact keys needs no mask tile and runs its interior blocks
unmasked. Both compiled by kiln (tune none, one compile per T), kernel time by the profiler at
T = 128 and 2048 from position 0; torch's SDPA (flash, causal, exact keys) as the peer.

GPU: PYTHONPATH=. python benchmarks/probes/prefill_attention.py [--out f.json]
        [--configs default nosplit bn128 ...] [--lengths 2048] [--rope] [--key-rope]

--configs forces the attention template's default config (tune none uses it) to each
named change: the next step is why kiln's causal kernel runs at ~60% of torch's flash
at 2048 (an H200, 2026-11-29: 259 vs 420 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from decode_attention import kernel_us  # this folder's: run as a script
from torch import nn

import kiln
from kiln.codegen.templates.attention import template

HEADS, KV_HEADS, D, CACHE = 32, 8, 128, 2304
LENGTHS = (128, 2048)
CONFIGS = {  # name -> changes to the template's default config
    "default": {},
    "nosplit": {"KV_SPLIT": 1},  # the split's code compiled out (sm_90: 224 registers, not 255)
    "bn128": {"BLOCK_N": 128, "KV_SPLIT": 1},
    "stages3": {"stages": 3, "KV_SPLIT": 1},
    "bm64": {"BLOCK_M": 64, "KV_SPLIT": 1},
    "bm64_warps4": {"BLOCK_M": 64, "warps": 4, "KV_SPLIT": 1},
}


@contextmanager
def forced(change: dict):
    """The attention template's default config with `change` applied, while inside."""
    heuristic = template.heuristic

    def pick(shape, rows_hi, target):
        c = heuristic(shape, rows_hi, target)
        tiles = {k: change.get(k, c[k]) for k in ("BLOCK_M", "BLOCK_N", "KV_SPLIT")}
        return type(c).make(change.get("warps", c.num_warps),
                            change.get("stages", c.num_stages), **tiles)

    template.heuristic = pick
    try:
        yield
    finally:
        template.heuristic = heuristic


class MaskedCache(nn.Module):
    """kiln bench's subject: mask rows from a buffer, SDPA over the whole static cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("causal", torch.tril(torch.ones(CACHE, CACHE, dtype=torch.bool)))

    def forward(self, q, k_cache, v_cache, input_pos):
        mask = self.causal[None, None, input_pos]
        rep = HEADS // KV_HEADS
        k, v = (c.repeat_interleave(rep, dim=1) for c in (k_cache, v_cache))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class PrefixCache(nn.Module):
    """kiln.models' prompt mask over the whole static cache: key slot j passes query i
    when j <= input_pos[i], built from an arange and the positions (no buffer). Its form
    passes each row a prefix of the keys (dispatch/prefix_mask.py): no mask loops."""

    def forward(self, q, k_cache, v_cache, input_pos):
        mask = torch.arange(k_cache.shape[2], device=q.device)[None, :] <= input_pos[:, None]
        rep = HEADS // KV_HEADS
        k, v = (c.repeat_interleave(rep, dim=1) for c in (k_cache, v_cache))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


class MaskedCacheRope(MaskedCache):
    """MaskedCache with q's RoPE before it, as kiln bench's model has it (rotate-half
    over the position's angles): kiln computed it in the attention's prologue (144 us
    against 122 without it, an H200 at T 2048); now, in a prefill, in a pointwise
    kernel before it (dispatch/split_attention_prologues.py: `us_all` counts both)."""

    def __init__(self):
        super().__init__()
        half = D // 2
        angles = torch.outer(torch.arange(CACHE).float(),
                             1.0 / (500000.0 ** (torch.arange(half).float() / half)))
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, q, k_cache, v_cache, input_pos):
        cos, sin = self.cos[input_pos].to(q.dtype), self.sin[input_pos].to(q.dtype)
        q1, q2 = q[..., :D // 2], q[..., D // 2:]
        q = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
        return super().forward(q, k_cache, v_cache, input_pos)


class SelfRope(nn.Module):
    """Attention over the prompt's own keys with RoPE on q and k, cos and sin made from
    inv_freq and the positions (transformers' Llama with use_cache=False): k's RoPE
    either in a kernel before the attention (the default) or in its key loop, once per
    query tile walking the block (`_key_fused`: options key_prologue_split=False)."""

    def __init__(self):
        super().__init__()
        half = D // 2
        self.register_buffer("inv_freq", 1.0 / (500000.0 ** (torch.arange(half).float() / half)))

    def forward(self, q, k_cache, v_cache, input_pos):
        t = q.shape[2]
        angles = input_pos.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
        k, v = k_cache[:, :, :t], v_cache[:, :, :t]

        def rope(x):
            x1, x2 = x[..., :D // 2], x[..., D // 2:]
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin

        return F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True,
                                              enable_gqa=True)


class CausalExact(nn.Module):
    """The same attention over the first T keys with is_causal (no mask tensor)."""

    def forward(self, q, k_cache, v_cache, input_pos):
        t = q.shape[2]
        rep = HEADS // KV_HEADS
        k, v = (c[:, :, :t].repeat_interleave(rep, dim=1) for c in (k_cache, v_cache))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--configs", nargs="+", default=["default"], choices=list(CONFIGS))
    ap.add_argument("--lengths", nargs="+", type=int, default=list(LENGTHS))
    ap.add_argument("--rope", action="store_true",
                    help="also gpt-fast's mask with q's RoPE before it: split into its own "
                         "kernel (the default) and kept in the attention's prologue (_fused)")
    ap.add_argument("--key-rope", action="store_true",
                    help="also attention over the prompt's own keys with q's and k's RoPE "
                         "(no cache): k's RoPE in its own kernel (the default) and in the "
                         "key loop (_key_fused)")
    args = ap.parse_args()
    os.environ["KILN_COMPILE_CACHE"] = "0"
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp()
    dev, dt = "cuda", torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(1, KV_HEADS, CACHE, D, generator=g).to(dev, dt) for _ in range(2))
    rows = []
    mods = {}
    modules = [("masked_cache", MaskedCache), ("prefix_cache", PrefixCache),
               ("causal_exact", CausalExact)]
    if args.rope:
        modules += [("masked_cache_rope", MaskedCacheRope),
                    ("masked_cache_rope_fused", MaskedCacheRope)]
    if args.key_rope:
        modules += [("self_rope", SelfRope), ("self_rope_key_fused", SelfRope)]
    variants = [(name, cls, c) for c in args.configs for name, cls in modules]
    for t in args.lengths:  # one compile per length: a dynamic T meets a guard torch cannot prove
        for name, cls, c in variants:
            m = cls().to(dev)
            ex = (torch.randn(1, HEADS, t, D, device=dev, dtype=dt), kc, vc,
                  torch.arange(t, device=dev))
            with forced(CONFIGS[c]):
                opts = {"tune": "none",
                        "query_prologue_split": not name.endswith("cache_rope_fused"),
                        "key_prologue_split": not name.endswith("_key_fused")}
                mods[name, c, t] = (m, kiln.compile(m, ex, target="cuda", options=opts))
    for t in args.lengths:
        q = torch.randn(1, HEADS, t, D, generator=g).to(dev, dt)
        pos = torch.arange(t, device=dev)
        k, v = kc[:, :, :t], vc[:, :, :t]
        us = kernel_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), "")
        flops = 4 * HEADS * t * t * D / 2
        rows.append(dict(variant="torch_causal_exact", t=t, us=us, tflops=flops / us / 1e6))
        for name, _, c in variants:
            m, mod = mods[name, c, t]
            out, ref = mod(q, kc, vc, pos), m(q, kc, vc, pos)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            call = (lambda mod=mod, q=q, pos=pos: mod(q, kc, vc, pos))
            us, us_all = kernel_us(call, "attention"), kernel_us(call, "")
            label = name if c == "default" else f"{name}[{c}]"
            rows.append(dict(variant=label, t=t, us=us, err=err, tflops=flops / us / 1e6,
                             us_all=us_all))
    report(rows, args.out, 32)


def report(rows: list[dict], out: str | None, width: int) -> None:
    """Print each row (variant, length, time, rate, error; or why it did not run) and
    write them all to `out` as JSON."""
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:{width}s} T {r['t']:5d} {r['error']}")
            continue
        print(f"{r['variant']:{width}s} T {r['t']:5d} {r['us']:9.1f} us {r['tflops']:6.0f} "
              "TFLOP/s" + (f" err {r['err']:.1e}" if "err" in r else "")
              + (f" (every kernel of the call {r['us_all']:.1f} us)" if "us_all" in r else ""),
              flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
