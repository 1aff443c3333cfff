"""Probe: does the one-token GEMV's loop form or config explain its ~3.5 us over the copy
floor (issue 10, issue 14's Qwen3-Next decode)? A standalone copy of kiln's GEMV loop
(templates/matmul, split K, the last program merging parts) in three forms: 0 = kiln's
(a cross-lane sum every K step), 1 = products summed elementwise and one cross-lane sum
after the loop, 2 = form 1 with the next step's weight tile loaded before this step's
products (Triton 3.6 software-pipelines none of these loads: compile-only sm_90, no
cp.async at any num_stages). Every (BLOCK_N, BLOCK_K, split cap, form) at Llama-3-8B's
and Qwen3-Next's projection widths, fp16, each timed as 20+ launches over distinct weights
(L2 cold) in one CUDA graph, no PDL; floor = bytes at this run's copy rate.

GPU: PYTHONPATH=. python benchmarks/probes/gemv_forms.py [wo,wqkv,qn_in,...]  ($OUT: JSON)
"""
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def gemv(w_ptr, x_ptr, out_ptr, ws_ptr, lock_ptr, N: tl.constexpr, K: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
         FORM: tl.constexpr):
    pid = tl.program_id(0)
    pid_s = tl.program_id(2)
    n_split = tl.num_programs(2)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rb2 = (rn % N)[None, :]
    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    lo = 0
    hi = K
    if SPLIT_K > 1:
        per_split = tl.cdiv(tl.cdiv(K, n_split), BLOCK_K) * BLOCK_K
        lo = pid_s * per_split
        hi = tl.minimum(K, lo + per_split)
    if FORM == 0:  # kiln's loop: the cross-lane sum every step
        for k0 in range(lo, hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            w0 = tl.load(w_ptr + (kk[:, None] + K * rb2)).to(tl.float32)
            x = tl.load(x_ptr + kk).to(tl.float32)
            acc += tl.sum(x[:, None] * w0, 0)[None, :]
    elif FORM == 1:  # products summed elementwise, one cross-lane sum after the loop
        acc2 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            w0 = tl.load(w_ptr + (kk[:, None] + K * rb2)).to(tl.float32)
            x = tl.load(x_ptr + kk).to(tl.float32)
            acc2 += x[:, None] * w0
        acc += tl.sum(acc2, 0)[None, :]
    else:  # and the next step's weight tile loaded before this step's products
        acc2 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        kk = lo + tl.arange(0, BLOCK_K)
        wn = tl.load(w_ptr + (kk[:, None] + K * rb2))
        for k0 in range(lo, hi, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            w0 = wn.to(tl.float32)
            kn = kk + BLOCK_K
            wn = tl.load(w_ptr + (kn[:, None] + K * rb2), mask=kn[:, None] < hi, other=0.0)
            x = tl.load(x_ptr + kk).to(tl.float32)
            acc2 += x[:, None] * w0
        acc += tl.sum(acc2, 0)[None, :]
    rn2 = rn[None, :]
    n_ok = rn2 < N
    if SPLIT_K > 1:
        last = pid_s == 0
        if n_split > 1:
            offs = tl.arange(0, BLOCK_N)[None, :]
            tl.store(ws_ptr + (pid * n_split + pid_s) * BLOCK_N + offs, acc, mask=n_ok)
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel")
            last = arrived == n_split - 1
            if last:
                acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
                for part_first in range(0, n_split, 16):
                    for j in tl.static_range(16):
                        s = part_first + j
                        acc += tl.load(ws_ptr + (pid * n_split + s) * BLOCK_N + offs,
                                       mask=n_ok & (s < n_split), other=0.0, cache_modifier=".cg")
                tl.store(lock_ptr + pid, 0)
        n_ok = rn2 < tl.where(last, N, 0)
    tl.store(out_ptr + rn2, acc.to(tl.float16), n_ok)


def n_split(N, K, bn, bk, cap, sms):
    """kiln's split count (templates/split_k.count with GEMV_FILL 4)."""
    tiles = triton.cdiv(N, bn)
    return max(1, min(cap, (4 * sms) // max(1, tiles), triton.cdiv(K, bk)))


SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w2": (4096, 14336), "w13": (28672, 4096),
          "qn_out": (2048, 4096), "qn_in": (12352, 2048), "qn_router": (513, 2048),
          "qn_attn_in": (9216, 2048)}


def copy_gbps() -> float:
    """Device copy bandwidth (read + write) over 1 GiB, GB/s."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * (1 << 30) * 10 / (e0.elapsed_time(e1) * 1e-3) / 1e9


def graph_us(launch, count: int, reps: int = 5) -> float:
    """Median us per launch of `launch()` (which launches `count` kernels) in a graph."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        launch()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000 / count)
    return sorted(ts)[reps // 2]


def time_shape(N: int, K: int, sms: int) -> list[tuple]:
    """(us, BLOCK_N, BLOCK_K, warps, cap, splits, form, rel err) of every candidate."""
    copies = max(2, min(24, (600 << 20) // (N * K * 2)))
    ws = [torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
    x = torch.randn(K, device="cuda", dtype=torch.float16)
    ref = ws[-1].float() @ x.float()
    o = torch.empty(N, device="cuda", dtype=torch.float16)
    scratch = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
    lock = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    rows = []
    for bn, bk, warps, cap, form in itertools.product((32, 64), (128, 256), (4,),
                                                      (1, 4, 16), (0, 1, 2)):
        s = n_split(N, K, bn, bk, cap, sms)
        if cap > 1 and s == 1:
            continue
        grid = (triton.cdiv(N, bn), 1, s)

        def launch(grid=grid, bn=bn, bk=bk, cap=cap, form=form, warps=warps):
            for w in ws:
                gemv[grid](w, x, o, scratch, lock, N, K, bn, bk, cap, form,
                           num_warps=warps, num_stages=1)
        launch()
        err = ((o.float() - ref).norm() / ref.norm()).item()
        rows.append((graph_us(launch, copies), bn, bk, warps, cap, s, form, err))
    return sorted(rows)


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(SHAPES)
    bw = copy_gbps()
    print(f"copy {bw:.0f} GB/s  sms {sms}")
    out = {}
    for name in names:
        N, K = SHAPES[name]
        rows = time_shape(N, K, sms)
        floor = N * K * 2 / (bw * 1e9) * 1e6
        default = [r for r in rows if r[1:5] == (64, 128, 4, 16) and r[6] == 0]
        print(f"== {name} N {N} K {K}: {N * K * 2 / 1e6:.1f} MB, floor {floor:.2f} us; "
              f"kiln default {default[0][0] if default else float('nan'):.2f} us")
        for r in rows[:12]:
            print("   {:.2f} us  BN {} BK {} w{} cap {} split {} form {}  err {:.1e}".format(*r))
        for form in (0, 1, 2):
            best = [r for r in rows if r[6] == form][:3]
            print(f"   best form {form}:",
                  ["{:.2f} BN{} BK{} w{} cap{} s{}".format(*r[:6]) for r in best])
        out[name] = {"floor_us": floor, "rows": rows}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv_forms.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()
