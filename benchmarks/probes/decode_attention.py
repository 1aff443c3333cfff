"""Probe: the decode attention kernel's time against its bytes (issue 10: at batch 1 an
8B layer's attention took 8.5 us at context 128 on an H200, where its keys and values
are 0.5 MB). The attention of one gpt-fast layer (index_copy_ into a static cache,
repeat_interleave for GQA, SDPA with a boolean causal mask row sliced from a buffer),
compiled by kiln with tune none at each forced variant of the template's decode
config, timed per kernel with the profiler at several contexts; torch's SDPA on the
exact keys (no mask: flash / cuDNN's decode) as the peer.

GPU: PYTHONPATH=.:benchmarks python benchmarks/probes/decode_attention.py [--out f.json]
        [--shape llama3-8b|qwen3-next|llama2-7b] [--variants default fill2x ...] [--fit-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.codegen.templates import split_k
from kiln.codegen.templates.attention import template

HEADS, KV_HEADS, D, MAX_LEN = 32, 8, 128, 2304
SHAPES = {"llama3-8b": (32, 8, 128), "qwen3-next": (16, 2, 256),  # heads, kv heads, dim
          "llama2-7b": (32, 32, 128)}  # multi-head: the split fill decides its splits
CONTEXTS = (128, 512, 2048)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.randn(1, KV_HEADS, MAX_LEN, D) * 0.5)
        self.register_buffer("v_cache", torch.randn(1, KV_HEADS, MAX_LEN, D))
        self.register_buffer("causal", torch.tril(torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool)))

    def forward(self, q, k, v, input_pos):
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        mask = self.causal[None, None, input_pos]
        rep = HEADS // KV_HEADS
        keys = self.k_cache.repeat_interleave(rep, dim=1)
        values = self.v_cache.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


def rotary(x, freqs):
    """gpt-fast's apply_rotary_emb over [B, H, 1, D] (interleaved pairs; freqs [1, D/2, 2])."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs.view(1, 1, 1, xs.size(-2), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3).type_as(x)


class RopeAttention(Attention):
    """The same with the query's and key's RoPE before it (freqs gathered by position),
    as the model has it: kiln fuses q's into the attention's prologue, k's into the
    cache write. The difference from `Attention` is the prologue's cost."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freqs", torch.randn(MAX_LEN, D // 2, 2))

    def forward(self, q, k, v, input_pos):
        f = self.freqs[input_pos]
        return super().forward(rotary(q, f), rotary(k, f), v, input_pos)


def kernel_us(fn, match, calls=20):
    """Mean device time of the kernels whose name contains `match`, per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA" and match in e.name]
    return sum(e.time_range.elapsed_us() for e in evs) / calls


VARIANTS = {
    "default": {},
    "bn32": {"BLOCK_N": 32},
    "bn128": {"BLOCK_N": 128},
    "nosplit": {"KV_SPLIT": 1},
    "stages3": {"stages": 3},
    "stages1": {"stages": 1},
    "fill2x": {"fill": 2},
    "fill4x": {"fill": 4},
    "bn32_fill4x": {"BLOCK_N": 32, "fill": 4},
    "warps2": {"warps": 2},
    "rope": {"rope": True},  # the default config, q's RoPE in the prologue
    # one key block a split where MIN_SPLIT_BLOCKS (2) bounded the split first: at the
    # Llama-3 widths, context 512, 5 splits walking 2 blocks each (~2.5 us a block) ->
    # 9 walking 1 and a longer merge; never timed (the fill variants hit this bound)
    "min1": {"min_blocks": 1},
    "min1_fill2x": {"min_blocks": 1, "fill": 2},
}


def compiled(variant, dtype):
    heuristic, count = template.heuristic, split_k.count

    def forced(shape, rows_hi, target):
        c = heuristic(shape, rows_hi, target)
        kw = {k: variant.get(k, c[k]) for k in ("BLOCK_M", "BLOCK_N", "KV_SPLIT")}
        return type(c).make(variant.get("warps", c.num_warps), variant.get("stages", c.num_stages),
                            **kw)

    def more(cap, tiles, fill, most):
        return count(cap, tiles, f"({fill}) * {variant.get('fill', 1)}", most)

    template.heuristic, split_k.count = forced, more
    min_blocks = template.MIN_SPLIT_BLOCKS
    template.MIN_SPLIT_BLOCKS = variant.get("min_blocks", min_blocks)
    try:
        m = (RopeAttention if variant.get("rope") else Attention)().to("cuda", dtype)
        ex = (torch.randn(1, HEADS, 1, D, device="cuda", dtype=dtype),
              torch.randn(1, KV_HEADS, 1, D, device="cuda", dtype=dtype),
              torch.randn(1, KV_HEADS, 1, D, device="cuda", dtype=dtype),
              torch.tensor([5], device="cuda"))
        mod = kiln.compile(m, ex, target="cuda", options={"tune": "none"})
        mod.cuda_graphs()
        return m, mod, ex
    finally:
        template.heuristic, split_k.count = heuristic, count
        template.MIN_SPLIT_BLOCKS = min_blocks


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--fit-cache", action="store_true",
                    help="a cache of context + 8 slots (compiled per context), as "
                         "transformers' static-cache recipe sizes it: the split is then "
                         "bounded by the cache, where min1 differs")
    args = ap.parse_args()
    global HEADS, KV_HEADS, D, MAX_LEN
    HEADS, KV_HEADS, D = SHAPES[args.shape]
    os.environ["KILN_COMPILE_CACHE"] = "0"
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp()
    dtype = torch.float16
    rows = []
    q = torch.randn(1, HEADS, 1, D, device="cuda", dtype=dtype)
    kc = torch.randn(1, KV_HEADS, MAX_LEN, D, device="cuda", dtype=dtype)
    for ctx in CONTEXTS:
        k, v = kc[:, :, : ctx + 1], kc[:, :, : ctx + 1].flip(0)
        us = kernel_us(lambda k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                       "")
        floor = 2 * KV_HEADS * (ctx + 1) * D * 2 / 4.25e12 * 1e6
        print(f"torch sdpa exact keys ctx {ctx}: {us:.2f} us (bytes at 4.25 TB/s {floor:.2f})")
        rows.append(dict(variant="torch_exact", ctx=ctx, us=us, floor_us=floor))
    for name in args.variants:
        line, built = [], None
        for ctx in CONTEXTS:
            if built is None or args.fit_cache:
                if args.fit_cache:  # transformers' recipe: a cache a little past the context
                    MAX_LEN = ctx + 8
                try:
                    built = compiled(VARIANTS[name], dtype)
                except Exception as e:  # noqa: BLE001 - a variant that does not build
                    print(f"{name}: {e!s:.200}")
                    break
            m, mod, ex = built
            pos = torch.tensor([ctx], device="cuda")
            call = (ex[0], ex[1], ex[2], pos)
            out = mod(*call)
            ref = m(*call)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = kernel_us(lambda call=call, mod=mod: mod(*call), "attention")
            rows.append(dict(variant=name, ctx=ctx, us=us, err=err))
            line.append(f"ctx {ctx} {us:6.2f} us (err {err:.1e})")
        print(f"{name:12s} " + "  ".join(line), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
