"""Probe: what an explicit causal mask costs kiln's prefill attention (issue 10: prefill
2048 wants 0.90x torch.compile; attention is ~1/6 of the step).

gpt-fast's attention reads a boolean mask row per query, sliced from a [S, S] buffer by
the input positions, over the whole static cache; kiln bounds the key loop by the mask's
envelope and still loads the mask tile every step. The same attention written with
`is_causal=True` over the exact keys needs no mask tile and runs its interior blocks
unmasked. Both compiled by kiln (tune none, one compile per T), kernel time by the profiler at
T = 128 and 2048 from position 0; torch's SDPA (flash, causal, exact keys) as the peer.

GPU: PYTHONPATH=. python benchmarks/probes/prefill_attention.py [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from decode_attention import kernel_us  # this folder's: run as a script
from torch import nn

import kiln

HEADS, KV_HEADS, D, CACHE = 32, 8, 128, 2304
LENGTHS = (128, 2048)


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
    args = ap.parse_args()
    os.environ["KILN_COMPILE_CACHE"] = "0"
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp()
    dev, dt = "cuda", torch.float16
    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(1, KV_HEADS, CACHE, D, generator=g).to(dev, dt) for _ in range(2))
    rows = []
    mods = {}
    for t in LENGTHS:  # one compile per length: a dynamic T meets a guard torch cannot prove
        for name, cls in (("masked_cache", MaskedCache), ("causal_exact", CausalExact)):
            m = cls().to(dev)
            ex = (torch.randn(1, HEADS, t, D, device=dev, dtype=dt), kc, vc,
                  torch.arange(t, device=dev))
            mods[name, t] = (m, kiln.compile(m, ex, target="cuda", options={"tune": "none"}))
    for t in LENGTHS:
        q = torch.randn(1, HEADS, t, D, generator=g).to(dev, dt)
        pos = torch.arange(t, device=dev)
        k, v = kc[:, :, :t], vc[:, :, :t]
        us = kernel_us(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), "")
        flops = 4 * HEADS * t * t * D / 2
        rows.append(dict(variant="torch_causal_exact", t=t, us=us, tflops=flops / us / 1e6))
        for name in ("masked_cache", "causal_exact"):
            m, mod = mods[name, t]
            out, ref = mod(q, kc, vc, pos), m(q, kc, vc, pos)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            us = kernel_us(lambda mod=mod, q=q, pos=pos: mod(q, kc, vc, pos), "attention")
            rows.append(dict(variant=name, t=t, us=us, err=err, tflops=flops / us / 1e6))
    for r in rows:
        print(f"{r['variant']:20s} T {r['t']:5d} {r['us']:9.1f} us {r['tflops']:6.0f} TFLOP/s"
              + (f" err {r['err']:.1e}" if "err" in r else ""), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
