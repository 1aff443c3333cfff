"""Probe: does a one-token GEMV's fixed ~3.5 us over its bytes shrink when it overlaps
its predecessor (issue 10)? Chains of 20+ GEMVs over distinct weights in one CUDA graph
(gemv_forms.py's form 1), launched: plain; with PDL and the grid-dependency wait at the
top (kiln's form, codegen/build/grid_dependency.py); with the first weight tile read
into registers before the wait ("pre"); with `griddepcontrol.launch_dependents` after
the K loop ("release", so the next GEMV's blocks start during this one's merge and
tail); and both. Per GEMV us against bytes at this run's copy rate.

GPU: PYTHONPATH=.:benchmarks/probes python benchmarks/probes/gemv_pdl_overlap.py  ($OUT: JSON)
"""
import json
import os

import torch
import triton
import triton.language as tl
from gemv_forms import copy_gbps, graph_us
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def gemv(w_ptr, x_ptr, out_ptr, ws_ptr, lock_ptr, N: tl.constexpr, K: tl.constexpr,
         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
         WAIT: tl.constexpr, PRE: tl.constexpr, RELEASE: tl.constexpr):
    pid = tl.program_id(0)
    pid_s = tl.program_id(2)
    n_split = tl.num_programs(2)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rb2 = (rn % N)[None, :]
    lo = 0
    hi = K
    if SPLIT_K > 1:
        per_split = tl.cdiv(tl.cdiv(K, n_split), BLOCK_K) * BLOCK_K
        lo = pid_s * per_split
        hi = tl.minimum(K, lo + per_split)
    acc2 = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    start = lo
    if PRE:
        kk = lo + tl.arange(0, BLOCK_K)
        w_first = tl.load(w_ptr + (kk[:, None] + K * rb2), mask=kk[:, None] < hi, other=0.0)
    if WAIT:
        gdc_wait()
    if PRE:
        x = tl.load(x_ptr + kk, mask=kk < hi, other=0.0).to(tl.float32)
        acc2 += x[:, None] * w_first.to(tl.float32)
        start = lo + BLOCK_K
    for k0 in range(start, hi, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        w0 = tl.load(w_ptr + (kk[:, None] + K * rb2)).to(tl.float32)
        x = tl.load(x_ptr + kk).to(tl.float32)
        acc2 += x[:, None] * w0
    if RELEASE:
        gdc_launch_dependents()
    acc = tl.sum(acc2, 0)[None, :]
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


SHAPES = {"wqkv": (6144, 4096), "wo": (4096, 4096), "w2": (4096, 14336),
          "qn_out": (2048, 4096), "qn_in": (12352, 2048), "qn_router": (513, 2048)}
VARIANTS = {"plain": (0, 0, 0, False), "pdl wait": (1, 0, 0, True),
            "pdl pre": (1, 1, 0, True), "pdl release": (1, 0, 1, True),
            "pdl pre+release": (1, 1, 1, True)}


def launch_chain(steps, x, o, scratch, lock, sms, bn, bk, variant):
    wait, pre, release, pdl = VARIANTS[variant]
    for _, N, K, w in steps:
        s = max(1, min(16, (4 * sms) // triton.cdiv(N, bn), triton.cdiv(K, bk)))
        gemv[(triton.cdiv(N, bn), 1, s)](w, x[K], o, scratch, lock, N, K, bn, bk, 16, wait,
                                          pre, release, num_warps=4, num_stages=1,
                                          launch_pdl=pdl)


def chain(names: list[str]) -> list[tuple]:
    """(name, N, K, weight) GEMVs cycling through `names`, 24 or ~900 MB of weights."""
    steps, total = [], 0
    while len(steps) < 24 and total < (900 << 20):
        n = names[len(steps) % len(names)]
        N, K = SHAPES[n]
        steps.append((n, N, K, torch.randn(N, K, device="cuda", dtype=torch.float16) * 0.02))
        total += N * K * 2
    return steps


def main():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_gbps()
    print(f"copy {bw:.0f} GB/s")
    scratch = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
    lock = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)
    o = torch.empty(16384, device="cuda", dtype=torch.float16)
    chains = {n: [n] for n in SHAPES}
    chains["llama layer (wqkv, wo, w2)"] = ["wqkv", "wo", "w2"]
    results = {}
    for cname, names in chains.items():
        steps = chain(names)
        x = {K: torch.randn(K, device="cuda", dtype=torch.float16) for _, _, K, _ in steps}
        floor = sum(N * K * 2 for _, N, K, _ in steps) / (bw * 1e9) * 1e6 / len(steps)
        for bn, bk in ((64, 128), (32, 256)):
            line = []
            for variant in VARIANTS:
                def run(bn=bn, bk=bk, variant=variant, steps=steps, x=x):
                    launch_chain(steps, x, o, scratch, lock, sms, bn, bk, variant)
                run()
                _, N, K, w = steps[-1]
                ref = w.float() @ x[K].float()
                err = ((o[:N].float() - ref).norm() / ref.norm()).item()
                t = graph_us(run, len(steps), reps=7)
                line.append(f"{variant} {t:.2f}" + (f" ERR {err:.1e}" if err > 1e-2 else ""))
                results[f"{cname} {bn}x{bk} {variant}"] = (t, err)
            print(f"{cname:28s} BN{bn} BK{bk} floor {floor:.2f} us | " + " | ".join(line))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gemv_pdl_overlap.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
