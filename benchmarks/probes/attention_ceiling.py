"""Probe: how fast a plain causal flash-attention forward written in Triton runs on this
GPU, at the 8B widths (32 heads over 8 KV heads, head dim 128, fp16), beside torch's
SDPA. Issue 10's prefill 2048 wants 0.90x torch.compile; kiln's attention template at
`is_causal` ran 133 us against torch's flash 82 us at T 2048 (an H200, 2026-11-29). This
kernel has none of the template's generality (no masks, splits, fused prologues, symbolic
sizes, GQA row packing): what it reaches is the ceiling a change to the template can aim
at, and its variants say which of the template's choices cost what.

Variants: `ptr` (K read as a [D, BLOCK_N] tile through pointers, as the template does),
`ptr_kt` (K read [BLOCK_N, D] and transposed in registers), `tma` (Q, K, V through host
tensor descriptors); each at 128 x 64 / 8 warps / 2 and 3 stages and 128 x 128 / 8 warps /
2 stages.

GPU: PYTHONPATH=.:benchmarks python benchmarks/probes/attention_ceiling.py [--out f.json]
CPU: TRITON_INTERPRET=1 ... --check (tiny sizes, against eager; no timing)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _step(acc, m_i, l_i, q, k, v, qk_scale, rows, cols, MASKED: tl.constexpr):
    """One key block of the online softmax; MASKED applies the causal mask (key <= row)."""
    qk = tl.dot(q, k)
    if MASKED:
        qk = tl.where(cols[None, :] <= rows[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _ptr_kernel(Q, K, V, Out, qk_scale, T, H: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                KSTRIDE_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                K_ROWS: tl.constexpr):
    """Q, Out [H, T, D]; K, V [H // G, S, D] (the static cache, first T keys used)."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest row blocks first
    h = tl.program_id(1)
    kvh = h // G
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q = tl.load(Q + (h * T + rows[:, None]) * D + d[None, :], mask=rows[:, None] < T)
    kbase = K + kvh * KSTRIDE_S * D
    vbase = V + kvh * KSTRIDE_S * D
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo_masked = pid_m * BLOCK_M
    for start in range(0, lo_masked, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        if K_ROWS:
            k = tl.trans(tl.load(kbase + n[:, None] * D + d[None, :]))
        else:
            k = tl.load(kbase + n[None, :] * D + d[:, None])
        v = tl.load(vbase + n[:, None] * D + d[None, :])
        acc, m_i, l_i = _step(acc, m_i, l_i, q, k, v, qk_scale, rows, n, False)
    for start in range(lo_masked, tl.minimum(lo_masked + BLOCK_M, T), BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        if K_ROWS:
            k = tl.trans(tl.load(kbase + n[:, None] * D + d[None, :], mask=n[:, None] < T))
        else:
            k = tl.load(kbase + n[None, :] * D + d[:, None], mask=n[None, :] < T)
        v = tl.load(vbase + n[:, None] * D + d[None, :], mask=n[:, None] < T)
        acc, m_i, l_i = _step(acc, m_i, l_i, q, k, v, qk_scale, rows, n, True)
    acc = acc / l_i[:, None]
    tl.store(Out + (h * T + rows[:, None]) * D + d[None, :], acc.to(Out.dtype.element_ty),
             mask=rows[:, None] < T)


@triton.jit
def _tma_kernel(q_desc, k_desc, v_desc, o_desc, qk_scale, T, H: tl.constexpr,
                G: tl.constexpr, D: tl.constexpr, KSTRIDE_S: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The same through tensor descriptors over 2-D views: Q, O [H * T, D], K, V
    [H // G * S, D]; T a multiple of BLOCK_M."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    kv0 = (h // G) * KSTRIDE_S
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = q_desc.load([h * T + pid_m * BLOCK_M, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo_masked = pid_m * BLOCK_M
    for start in range(0, lo_masked, BLOCK_N):
        k = k_desc.load([kv0 + start, 0]).T
        v = v_desc.load([kv0 + start, 0])
        n = start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _step(acc, m_i, l_i, q, k, v, qk_scale, rows, n, False)
    for start in range(lo_masked, lo_masked + BLOCK_M, BLOCK_N):
        k = k_desc.load([kv0 + start, 0]).T
        v = v_desc.load([kv0 + start, 0])
        n = start + tl.arange(0, BLOCK_N)
        acc, m_i, l_i = _step(acc, m_i, l_i, q, k, v, qk_scale, rows, n, True)
    acc = acc / l_i[:, None]
    o_desc.store([h * T + pid_m * BLOCK_M, 0], acc.to(o_desc.dtype))


def attention(q, k_cache, v_cache, form: str, bm: int, bn: int, warps: int, stages: int):
    """Causal attention of q [1, H, T, D] over the first T keys of the caches
    [1, Hkv, S, D]."""
    _, h, t, d = q.shape
    hkv, s = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    scale = LOG2E / d ** 0.5
    grid = (triton.cdiv(t, bm), h)
    if form == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        descs = [TensorDescriptor.from_tensor(x.view(-1, d), [rows, d]) for x, rows in
                 ((q, bm), (k_cache, bn), (v_cache, bn), (out, bm))]
        _tma_kernel[grid](*descs, scale, t, h, h // hkv, d, s, bm, bn, num_warps=warps,
                          num_stages=stages)
    else:
        _ptr_kernel[grid](q, k_cache, v_cache, out, scale, t, h, h // hkv, d, s, bm, bn,
                          form == "ptr_kt", num_warps=warps, num_stages=stages)
    return out


VARIANTS = [(form, bm, bn, w, st) for form in ("ptr", "ptr_kt", "tma")
            for bm, bn, w, st in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2))]


def reference(q, kc, vc):
    t = q.shape[2]
    return F.scaled_dot_product_attention(q, kc[:, :, :t], vc[:, :, :t], is_causal=True,
                                          enable_gqa=True)


def check():
    """Interpreter: each pointer form against eager at a tiny size (fp32)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 48, 16, generator=g)
    kc, vc = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(2))
    ref = reference(q, kc, vc)
    for form in ("ptr", "ptr_kt"):
        out = attention(q, kc, vc, form, 16, 16, 4, 1)
        err = ((out - ref).norm() / ref.norm()).item()
        print(f"{form}: rel err {err:.2e}")
        assert err < 1e-5, form


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--lengths", nargs="+", type=int, default=[2048])
    args = ap.parse_args()
    if args.check:
        return check()
    from decode_attention import kernel_us  # this folder's: run as a script
    from prefill_attention import report

    dev, dt, heads, kv_heads, d, cache = "cuda", torch.float16, 32, 8, 128, 2304
    g = torch.Generator(device="cpu").manual_seed(0)
    kc, vc = (torch.randn(1, kv_heads, cache, d, generator=g).to(dev, dt) for _ in range(2))
    rows = []
    for t in args.lengths:
        q = torch.randn(1, heads, t, d, generator=g).to(dev, dt)
        ref = reference(q, kc, vc)
        flops = 4 * heads * t * t * d / 2
        us = kernel_us(lambda q=q: reference(q, kc, vc), "")
        rows.append(dict(variant="torch_sdpa", t=t, us=us, tflops=flops / us / 1e6))
        for form, bm, bn, w, st in VARIANTS:
            label = f"{form} {bm}x{bn} w{w} s{st}"
            try:
                out = attention(q, kc, vc, form, bm, bn, w, st)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                us = kernel_us(lambda q=q, c=(form, bm, bn, w, st): attention(q, kc, vc, *c),
                               "_kernel")
                rows.append(dict(variant=label, t=t, us=us, err=err, tflops=flops / us / 1e6))
            except Exception as e:  # a variant this Triton cannot build: say so, go on
                rows.append(dict(variant=label, t=t, error=f"{type(e).__name__}: {e}"[:200]))
    report(rows, args.out, 24)


if __name__ == "__main__":
    main()
