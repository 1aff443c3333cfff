"""Probe: would TMA loads of K and V (Hopper tensor descriptors) close kiln's causal
prefill attention gap? (issue 10: prefill 2048 wants 0.90x torch.compile; kiln's causal
kernel runs 112-118 us at the 8B widths, T 2048, on an H200 against torch's 81 us.)

A hand-written kernel with kiln's shape (GQA rows packed per KV head, the longest row
blocks first, unmasked blocks below the diagonal then masked ones, exp2 softmax, one
program per 128-row block, no key split) in two forms: K / V tiles through pointers
(what kiln emits) or through host TMA descriptors, at several tiles, stages and warps;
each checked against torch's SDPA and timed with CUDA-graph'd do_bench. torch's SDPA
(causal, exact keys) as the peer. The pointer form at kiln's default (128 x 64, 8 warps,
3 stages) should reproduce kiln's own kernel; if the TMA rows run well below it, the
attention template gets a TMA form.

Result (H200, 2026-12-02, results/attention-tma-h200-2026-12-02-thirtyseventh.json): no.
T 2048: pointers 107.6 us, TMA 108.7-128.1 (best 128 x 128 at 3 stages), torch 84.5;
T 4096: 347.5 against 342.2-412.2, torch 280.4. The pointer form is pipelined already.

GPU: PYTHONPATH=. python benchmarks/probes/attention_tma.py [--lengths 2048 4096] [--out f.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

HEADS, KV_HEADS, D = 32, 8, 128


@triton.jit
def _tile(ptr, desc, row0, start_n, D: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """A [BLOCK_N, D] tile of K or V from row `row0 + start_n`."""
    if TMA:
        return desc.load([row0 + start_n, 0])
    n = start_n + tl.arange(0, BLOCK_N)
    return tl.load(ptr + (row0 + n)[:, None] * D + tl.arange(0, D)[None, :])


@triton.jit
def _step(q, k_ptr, v_ptr, k_desc, v_desc, row0, start_n, qi, m_i, l_i, acc, qk_scale,
          D: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr, MASKED: tl.constexpr):
    """One key block of the online softmax (causal mask only on the diagonal blocks)."""
    k = _tile(k_ptr, k_desc, row0, start_n, D, BLOCK_N, TMA)
    qk = tl.dot(q, k.T) * qk_scale
    if MASKED:
        n = start_n + tl.arange(0, BLOCK_N)
        qk = tl.where(n[None, :] <= qi[:, None], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _tile(v_ptr, v_desc, row0, start_n, D, BLOCK_N, TMA)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def causal_attention(q_ptr, k_ptr, v_ptr, o_ptr, k_desc, v_desc, T: tl.constexpr, S, qk_scale,
                     GROUP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest row blocks first
    kvh = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # over GROUP * T, one head a block
    qi = rows % T
    d = tl.arange(0, D)
    q_rows = kvh * GROUP * T + rows  # q / o as [HEADS * T, D]
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_end = tl.minimum(T, tl.max(qi) + 1)
    full_end = tl.minimum(T, tl.min(qi) + 1) // BLOCK_N * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _step(q, k_ptr, v_ptr, k_desc, v_desc, kvh * S, start_n, qi, m_i, l_i,
                              acc, qk_scale, D, BLOCK_N, TMA, False)
    for start_n in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _step(q, k_ptr, v_ptr, k_desc, v_desc, kvh * S, start_n, qi, m_i, l_i,
                              acc, qk_scale, D, BLOCK_N, TMA, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + q_rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty))


VARIANTS = {  # name -> (TMA, BLOCK_M, BLOCK_N, warps, stages)
    "ptr_128x64_w8_s3": (False, 128, 64, 8, 3),  # kiln's default on Hopper
    "tma_128x64_w8_s3": (True, 128, 64, 8, 3),
    "tma_128x64_w8_s2": (True, 128, 64, 8, 2),
    "tma_128x128_w8_s2": (True, 128, 128, 8, 2),
    "tma_128x128_w8_s3": (True, 128, 128, 8, 3),
    "ptr_128x128_w8_s2": (False, 128, 128, 8, 2),
    "tma_64x128_w4_s3": (True, 64, 128, 4, 3),
}


def run(variant, q, kc, vc, t):
    tma, bm, bn, warps, stages = VARIANTS[variant]
    out = torch.empty_like(q)
    from triton.tools.tensor_descriptor import TensorDescriptor
    k2, v2 = kc.view(-1, D), vc.view(-1, D)
    kd, vd = (TensorDescriptor.from_tensor(x, [bn, D]) for x in (k2, v2))
    grid = (HEADS // KV_HEADS * t // bm, KV_HEADS)
    scale = D ** -0.5 * 1.4426950408889634

    def call():
        causal_attention[grid](q, kc, vc, out, kd, vd, t, kc.shape[2], scale,
                               GROUP=HEADS // KV_HEADS, D=D, BLOCK_M=bm, BLOCK_N=bn, TMA=tma,
                               num_warps=warps, num_stages=stages)
        return out
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = "cuda"
    rows, g = [], torch.Generator(device="cpu").manual_seed(0)
    for t in args.lengths:
        cache = t + 256
        q = torch.randn(1, HEADS, t, D, generator=g).to(dev, torch.float16)
        kc, vc = (torch.randn(1, KV_HEADS, cache, D, generator=g).to(dev, torch.float16)
                  for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), kc[:, :, :t].float(),
                                             vc[:, :, :t].float(), is_causal=True,
                                             enable_gqa=True)
        flops = 4 * HEADS * t * t * D / 2
        if not args.check_only:
            k, v = kc[:, :, :t], vc[:, :, :t]
            us = triton.testing.do_bench_cudagraph(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True)) * 1e3
            rows.append(dict(variant="torch_sdpa", t=t, us=us, tflops=flops / us / 1e6))
        for v in args.variants:
            try:
                call = run(v, q, kc, vc, t)
                out = call()
                err = ((out.float() - ref).norm() / ref.norm()).item()
                row = dict(variant=v, t=t, err=err)
                if not args.check_only:
                    us = triton.testing.do_bench_cudagraph(call) * 1e3
                    row.update(us=us, tflops=flops / us / 1e6)
            except Exception as e:  # a variant Triton refuses: say so, go on
                row = dict(variant=v, t=t, error=f"{type(e).__name__}: {str(e)[:200]}")
            rows.append(row)
            print(row, flush=True)
    for r in rows:
        print(f"{r['variant']:20s} T {r['t']:5d} " + (
            r["error"] if "error" in r else
            (f"{r['us']:8.1f} us {r['tflops']:5.0f} TFLOP/s " if "us" in r else "")
            + (f"err {r['err']:.1e}" if "err" in r else "")))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
