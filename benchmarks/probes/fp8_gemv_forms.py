"""Probe: what limits the one-token fp8 GEMV (issue 13: Llama-3-8B fp8 decode ran its
linears at ~1.4x their bytes on an H200). Hand-written Triton kernels of the same
shape as kiln's GEMV form (a program owns BN weight rows and a K run; a step loads
[BN, KB, 128] e4m3 bytes), differing only in the arithmetic per weight byte:

  wonly    the weight widened and summed, times its block scale (no x at all)
  inkernel x (bf16) quantised per 128-block inside every program, as kiln does now
  preq     x quantised once beforehand (e4m3 + its scales): the GEMV loads them
  bf16     a bf16 weight of the same shape (twice the bytes), x bf16: the fp16 GEMV
  swap     the tensor cores with the operands swapped: out^T = W x^T, the weight rows
           the dot's M (64 or 128, so sm_90's fp8 wgmma), the tokens its N (padded to
           16), one 128-wide scale block a step, x quantised beforehand
  swapq    the same, x (bf16) quantised per block inside the program

Each kernel runs back to back over enough distinct weight copies (> 2 GB) that none
sits in L2, captured in one CUDA graph, time / copies = one call. K-split partial
sums are stored unreduced (the reduce is the same for every form). Ratios are against
the weight bytes at the device copy rate measured in the same run.

GPU: PYTHONPATH=.:benchmarks python benchmarks/probes/fp8_gemv_forms.py [--out f.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from measure import copy_bandwidth

SHAPES = {"llama_qkv": (6144, 4096), "llama_o": (4096, 4096), "llama_w13": (28672, 4096),
          "llama_w2": (4096, 14336), "v3_o": (7168, 16384), "v3_up": (18432, 7168),
          "v3_q_a": (1536, 7168)}


# (BN, KB, warps): 64 to 256 weight bytes a thread a step
TILES = [(16, 4, 4), (32, 2, 4), (32, 4, 4), (64, 2, 4), (64, 4, 4), (64, 4, 8), (128, 1, 4),
         (128, 2, 8)]


@triton.jit
def gemv(w_ptr, ws_ptr, x_ptr, xq_ptr, xs_ptr, out_ptr, N, K: tl.constexpr,
         BN: tl.constexpr, KB: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    wn = rn[:, None, None]
    kx = tl.arange(0, KB)[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    sn = (rn // 128)[:, None]
    per = K // SPLIT
    acc = tl.zeros([BN, KB], tl.float32)
    for k0 in range(pid_s * per, pid_s * per + per, KB * 128):
        kk = k0 + kx
        kb = k0 // 128 + tl.arange(0, KB)[None, :]
        if MODE == 0:
            w = tl.load(w_ptr + wn * K + kk, mask=wn < N, other=0.0)
            ws = tl.load(ws_ptr + sn * (K // 128) + kb, mask=sn < N // 128, other=0.0)
            acc += tl.sum(w.to(tl.float32), 2) * ws
        elif MODE == 1:
            xf = tl.broadcast_to(tl.load(x_ptr + kk).to(tl.float32), [1, KB, 128])
            amax = tl.maximum(tl.max(tl.abs(xf), 2), 1e-12)
            xs = amax * (1.0 / 448.0)
            xv = xf * (tl.math.div_rn(1.0, amax) * 448.0)[:, :, None]
            xv = tl.minimum(tl.maximum(xv, -448.0), 448.0)
            xq = xv.to(tl.float8e4nv).to(tl.float32)
            ws = tl.load(ws_ptr + sn * (K // 128) + kb, mask=sn < N // 128, other=0.0)
            w = tl.load(w_ptr + wn * K + kk, mask=wn < N, other=0.0)
            acc += tl.sum(xq * w.to(tl.float32), 2) * xs * ws
        elif MODE == 2:
            xq = tl.load(xq_ptr + kk).to(tl.float32)
            xs = tl.load(xs_ptr + kb)
            ws = tl.load(ws_ptr + sn * (K // 128) + kb, mask=sn < N // 128, other=0.0)
            w = tl.load(w_ptr + wn * K + kk, mask=wn < N, other=0.0)
            acc += tl.sum(xq * w.to(tl.float32), 2) * xs * ws
        else:
            xf = tl.load(x_ptr + kk).to(tl.float32)
            w = tl.load(w_ptr + wn * K + kk, mask=wn < N, other=0.0)
            acc += tl.sum(xf * w.to(tl.float32), 2)
    tl.store(out_ptr + pid_s * N + rn, tl.sum(acc, 1), mask=rn < N)


@triton.jit
def gemv_swap(w_ptr, ws_ptr, x_ptr, xq_ptr, xs_ptr, out_ptr, N, M, K: tl.constexpr,
              BN: tl.constexpr, BT: tl.constexpr, SPLIT: tl.constexpr, MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, 128)
    rt = tl.arange(0, BT)
    per = K // SPLIT
    acc = tl.zeros([BN, BT], tl.float32)
    srow = (pid_n * BN) // 128 * (K // 128)
    for k0 in range(pid_s * per, pid_s * per + per, 128):
        w = tl.load(w_ptr + rn[:, None] * K + k0 + rk[None, :])
        ws = tl.load(ws_ptr + srow + k0 // 128)
        if MODE == 4:
            xq = tl.load(xq_ptr + rt[None, :] * K + k0 + rk[:, None], mask=rt[None, :] < M,
                         other=0.0)
            xs = tl.load(xs_ptr + rt * (K // 128) + k0 // 128, mask=rt < M, other=0.0)
        else:
            xf = tl.load(x_ptr + rt[None, :] * K + k0 + rk[:, None], mask=rt[None, :] < M,
                         other=0.0).to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(xf), 0), 1e-12)
            xs = amax * (1.0 / 448.0)
            xv = xf * (tl.math.div_rn(1.0, amax) * 448.0)[None, :]
            xq = tl.minimum(tl.maximum(xv, -448.0), 448.0).to(tl.float8e4nv)
        acc += tl.dot(w, xq) * (ws * xs)[None, :]
    tl.store(out_ptr + pid_s * N + rn[:, None] + rt[None, :] * 0, acc,
             mask=(rn[:, None] < N) & (rt[None, :] < M))


def run_swap(shape, mode, bn, stages, split, warps, ws, dev):
    """One call of gemv_swap per weight copy (M = 1), as run()."""
    n, k = shape
    sc, x, xq, xs = operands(n, k, dev)
    out = torch.empty(split, n, device=dev)
    grid = (triton.cdiv(n, bn), split)

    def call(w):
        gemv_swap[grid](w, sc, x, xq, xs, out, n, 1, k, BN=bn, BT=16, SPLIT=split, MODE=mode,
                        num_warps=warps, num_stages=stages)

    call(ws[0])
    wd = ws[0].float().view(n, k // 128, 128) * sc.repeat_interleave(128, 0)[:n, :, None]
    ref = (wd.view(n, k) * (xq.float().view(-1, 128) * xs[:, None]).view(-1)).sum(1)
    err = ((out.sum(0) - ref).norm() / ref.norm()).item()
    return _graph_ms(call, ws), err


def _graph_ms(call, ws):
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            call(w)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / len(ws))
    return sorted(ts)[2]


def operands(n, k, dev):
    """The weight's block scales, x (bf16) and x quantised per 128-block (e4m3, scales)."""
    sc = torch.rand(n // 128, k // 128, device=dev) + 0.5
    x = torch.randn(k, device=dev, dtype=torch.bfloat16)
    xr = x.float().view(-1, 128)
    xs = xr.abs().amax(1).clamp_min(1e-12) / 448
    xq = (xr / xs[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(-1)
    return sc, x, xq, xs


def weights(shape, mode, copies, dev):
    wdt = torch.bfloat16 if mode == 3 else torch.float8_e4m3fn
    return [torch.randn(*shape, device=dev).to(wdt) for _ in range(copies)]


def run(shape, mode, bn, kb, split, warps, ws, dev):
    n, k = shape
    sc, x, xq, xs = operands(n, k, dev)
    out = torch.empty(split, n, device=dev)
    grid = (triton.cdiv(n, bn), split)

    def call(w):
        gemv[grid](w, sc, x, xq, xs, out, n, k, BN=bn, KB=kb, SPLIT=split, MODE=mode,
                   num_warps=warps, num_stages=1)

    call(ws[0])
    ref = {0: (ws[0].float().view(n, k // 128, 128).sum(2) * sc.repeat_interleave(128, 0)[:n]
               ).sum(1),
           3: ws[0].float() @ x.float()}.get(mode)
    if mode in (1, 2):
        wd = ws[0].float().view(n, k // 128, 128) * sc.repeat_interleave(128, 0)[:n, :, None]
        ref = (wd.view(n, k) * (xq.float().view(-1, 128) * xs[:, None]).view(-1)).sum(1)
    err = ((out.sum(0) - ref).norm() / ref.norm()).item()
    return _graph_ms(call, ws), err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--modes", nargs="*", type=int, default=[0, 1, 2, 3, 4, 5])
    args = ap.parse_args()
    dev = "cuda"
    bw = copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name()} copy {bw / 1e9:.0f} GB/s", flush=True)
    names = {0: "wonly", 1: "inkernel", 2: "preq", 3: "bf16", 4: "swap", 5: "swapq"}
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        for mode in args.modes:
            wbytes = n * k * (2 if mode == 3 else 1)
            copies = max(4, int(2.5e9 // wbytes))
            floor_ms = wbytes / bw * 1e3
            best = None
            ws = weights((n, k), mode, copies, dev)
            sweep = itertools.product(TILES, (1, 4, 16))
            if mode >= 4:  # (BN, stages, warps)
                sweep = itertools.product(itertools.product((64, 128), (3, 4, 6), (4,)),
                                          (1, 2, 4, 8, 16))
            for (bn, kb, warps), split in sweep:
                if mode == 3 and kb == 4:
                    continue
                step = 128 if mode >= 4 else kb * 128
                if k % (split * step) or (n // bn) * split < 100 or n // bn * split > 8192:
                    continue
                try:
                    runner = run_swap if mode >= 4 else run
                    ms, err = runner((n, k), mode, bn, kb, split, warps, ws, dev)
                except Exception as e:  # noqa: BLE001 - a config the compiler rejects
                    print(f"  {name} {names[mode]} BN{bn} KB{kb} S{split} w{warps}: {e!s:.80}")
                    continue
                row = dict(shape=name, mode=names[mode], BN=bn, KB=kb, SPLIT=split,
                           warps=warps, us=ms * 1e3, x_floor=ms / floor_ms, err=err)
                rows.append(row)
                if best is None or ms < best["us"] / 1e3:
                    best = row
            del ws
            if best:
                print(f"{name:10s} {names[mode]:8s} floor {floor_ms * 1e3:6.1f} us  best "
                      f"{best['us']:6.1f} us x{best['x_floor']:.2f}  BN{best['BN']} "
                      f"KB{best['KB']} S{best['SPLIT']} w{best['warps']} err {best['err']:.1e}",
                      flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
