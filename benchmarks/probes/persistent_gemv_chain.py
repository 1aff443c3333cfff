"""Probe: how much of a decode step's GEMV overhead would one persistent kernel remove
(issue 10, issue 14)? Each decode GEMV costs ~3.5 us over its bytes whatever its form,
config or PDL overlap (gemv_forms.py, gemv_pdl_overlap.py; the in-model PDL forms were
slower): a launch's ramp, the split merge and the tail. A persistent kernel keeps every
program resident and passes from one product to the next at a grid-wide barrier instead
of a kernel boundary. If the chain runs near its bytes that way, a persistent decode
layer is the road to issue 10's 1.10x; if not, the cost is the memory system's.

The chain: 8 layers of Llama-3-8B's four decode GEMVs (wqkv, wo, w13, w2; distinct
weights, ~3.5 GB, L2 cold), each product's input the previous one's output (its first K
values). Forms, each in one CUDA graph:
- kernels: a GEMV launch per product (kiln's loop, split K with the last program merging
  the parts; plain, and as PDL dependents waiting at their top);
- persistent: one launch of SMs x R programs; each product's (column block, K split)
  tiles dealt round-robin, partial sums added atomically into a zeroed fp32 output, then
  a grid barrier (an acq_rel counter) before the next product reads it.
Per-GEMV us against the bytes at this run's copy rate; every form checked against torch.

GPU: PYTHONPATH=.:benchmarks/probes python benchmarks/probes/persistent_gemv_chain.py
"""
import json
import os

import torch
import triton
import triton.language as tl
from gemv_forms import copy_gbps, graph_us
from gemv_pdl_overlap import gemv

LAYERS = 8
REPS = 15  # graph replays a figure (median)
SHAPES = [("wqkv", 6144, 4096), ("wo", 4096, 4096), ("w13", 28672, 4096),
          ("w2", 4096, 14336)]


@triton.jit
def _stage(meta_ptr, w_ptr, act_ptr, st):
    m = meta_ptr + st * 6
    # sizes and offsets come from memory: say what they divide, or every load is
    # scalar (the kernels form has N and K as constants)
    N = tl.multiple_of(tl.load(m).to(tl.int32), 64)
    K = tl.multiple_of(tl.load(m + 1).to(tl.int32), 128)
    S = tl.load(m + 2).to(tl.int32)
    wp = w_ptr + tl.multiple_of(tl.load(m + 3), 1024)
    xp = act_ptr + tl.multiple_of(tl.load(m + 4), 64)
    op = act_ptr + tl.multiple_of(tl.load(m + 5), 64)
    return N, K, S, wp, xp, op


@triton.jit
def _tile(t, S, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Tile t's columns and K range."""
    nb = t // S
    s = t % S
    rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    per = tl.cdiv(tl.cdiv(K, S), BLOCK_K) * BLOCK_K
    lo = s * per
    return rn, lo, tl.minimum(K, lo + per)


@triton.jit
def persistent_chain(w_ptr, act_ptr, meta_ptr, count_ptr, STAGES: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE: tl.constexpr):
    """meta: per stage [N, K, splits, weight offset, input offset, output offset]
    (offsets in elements into w and act; act starts with x0 as fp32). PRE: before the
    barrier ending a product, each program reads its first weight tile of the next one
    (weights do not depend on the product before)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    w_pre = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float16)
    if PRE:
        N0, K0, S0, wp0, _, _ = _stage(meta_ptr, w_ptr, act_ptr, 0)
        rn0, lo0, hi0 = _tile(pid, S0, K0, BLOCK_N, BLOCK_K)
        kk0 = lo0 + tl.arange(0, BLOCK_K)
        w_pre = tl.load(wp0 + kk0[:, None] + K0 * rn0[None, :],
                        mask=pid < tl.cdiv(N0, BLOCK_N) * S0, other=0.0)
    for st in range(STAGES):
        N, K, S, wp, xp, op = _stage(meta_ptr, w_ptr, act_ptr, st)
        tiles = tl.cdiv(N, BLOCK_N) * S
        for t in range(pid, tiles, P):
            rn, lo, hi = _tile(t, S, K, BLOCK_N, BLOCK_K)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(lo, hi, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                if PRE and (t == pid) and (k0 == lo):
                    w = w_pre
                else:
                    w = tl.load(wp + kk[:, None] + K * rn[None, :])
                x = tl.load(xp + kk, cache_modifier=".cg")
                acc += tl.sum(x[:, None] * w.to(tl.float32), 0)
            tl.atomic_add(op + rn, acc, mask=rn < N, sem="relaxed")
        if PRE:  # noqa: SIM102 - a constexpr test apart from the run-time one
            if st + 1 < STAGES:
                N2, K2, S2, wp2, _, _ = _stage(meta_ptr, w_ptr, act_ptr, st + 1)
                rn2, lo2, hi2 = _tile(pid, S2, K2, BLOCK_N, BLOCK_K)
                kk2 = lo2 + tl.arange(0, BLOCK_K)
                ok = pid < tl.cdiv(N2, BLOCK_N) * S2
                w_pre = tl.load(wp2 + kk2[:, None] + K2 * rn2[None, :], mask=ok, other=0.0)
        # grid barrier: every program's adds are done before any program reads them
        tl.debug_barrier()
        seen = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") + 1
        target = (st + 1) * P
        while seen < target:
            seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
        tl.debug_barrier()


class Chain:
    def __init__(self):
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.stages = [(name, N, K) for _ in range(LAYERS) for name, N, K in SHAPES]
        sizes = [N * K for _, N, K in self.stages]
        self.w = torch.randn(sum(sizes), device="cuda", dtype=torch.float16) * 0.02
        offs = [0]
        for n in sizes:
            offs.append(offs[-1] + n)
        self.w_off = offs[:-1]
        for i, (_, _, K) in enumerate(self.stages):  # outputs keep the inputs' scale
            self.weight(i).mul_(50.0 / K ** 0.5)
        self.x0 = torch.randn(14336, device="cuda", dtype=torch.float16)
        outs = [14336]  # x0's fp32 copy first
        for _, N, _ in self.stages:
            outs.append(outs[-1] + N)
        self.out_off = outs[:-1]
        self.act = torch.zeros(outs[-1], device="cuda", dtype=torch.float32)
        self.count = torch.zeros(1, device="cuda", dtype=torch.int32)
        self.bytes = sum(sizes) * 2
        # the kernels form: fp16 activations between launches
        self.h = [torch.empty(N, device="cuda", dtype=torch.float16) for _, N, _ in self.stages]
        self.scratch = torch.empty(64 << 20, device="cuda", dtype=torch.float32)
        self.lock = torch.zeros(1 << 16, device="cuda", dtype=torch.int32)

    def weight(self, i: int) -> torch.Tensor:
        _, N, K = self.stages[i]
        return self.w[self.w_off[i]:self.w_off[i] + N * K].view(N, K)

    def reference(self) -> torch.Tensor:
        x = self.x0.float()
        for i, (_, _, K) in enumerate(self.stages):
            x = self.weight(i).float() @ x[:K]
        return x

    def kernels(self, pdl: bool):
        x = self.x0
        for i, (_, N, K) in enumerate(self.stages):
            bn, bk = 64, 128
            s = max(1, min(16, (4 * self.sms) // triton.cdiv(N, bn), triton.cdiv(K, bk)))
            gemv[(triton.cdiv(N, bn), 1, s)](self.weight(i), x, self.h[i], self.scratch,
                                              self.lock, N, K, bn, bk, 16, int(pdl), 0, 0,
                                              num_warps=4, num_stages=1, launch_pdl=pdl)
            x = self.h[i]

    def meta(self, programs: int, fill: int) -> torch.Tensor:
        rows = []
        for i, (_, N, K) in enumerate(self.stages):
            cols = triton.cdiv(N, 64)
            splits = max(1, min(triton.cdiv(K, 128), (fill * programs) // cols))
            rows.append([N, K, splits, self.w_off[i], 0 if i == 0 else self.out_off[i - 1],
                         self.out_off[i]])
        return torch.tensor(rows, device="cuda", dtype=torch.int64)

    def persistent(self, programs: int, meta: torch.Tensor, pre: bool = False):
        self.act.zero_()
        self.act[:14336].copy_(self.x0)
        self.count.zero_()
        return persistent_chain[(programs,)](self.w, self.act, meta, self.count,
                                             len(self.stages), 64, 128, int(pre),
                                             num_warps=4, num_stages=1)

    def output(self) -> torch.Tensor:
        return self.act[self.out_off[-1]:]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    bw = copy_gbps()
    c = Chain()
    n = len(c.stages)
    floor = c.bytes / (bw * 1e9) * 1e6
    ref = c.reference()
    print(f"copy {bw:.0f} GB/s; {n} GEMVs, {c.bytes / 2**30:.2f} GiB, floor {floor / n:.2f} us "
          "a GEMV")
    results = {"copy_gbs": bw, "floor_us_per_gemv": floor / n}
    for pdl in (False, True):
        c.kernels(pdl)
        err = rel(c.h[-1], ref)
        t = graph_us(lambda p=pdl: c.kernels(p), 1, REPS)
        results[f"kernels pdl={pdl}"] = (t / n, err)
        print(f"kernels{' (PDL)' if pdl else ''}: {t / n:.2f} us a GEMV ({t / floor:.3f}x bytes), "
              f"err {err:.1e}")
    for pre in (False, True):
        # one program an SM is resident whatever its registers; their count bounds the rest
        compiled = c.persistent(c.sms, c.meta(c.sms, 1), pre)
        torch.cuda.synchronize()
        regs = getattr(compiled, "n_regs", None)
        fit = 1 if not regs else max(1, min(8, 65536 // (max(regs, 32) * 128)))
        print(f"{'next tile first: ' if pre else ''}registers {regs}, spills "
              f"{getattr(compiled, 'n_spills', None)}: up to {fit} programs an SM")
        for per_sm in sorted({min(2, fit), min(4, fit), fit}):
            for fill in (1, 2, 4):
                programs = c.sms * per_sm
                meta = c.meta(programs, fill)
                c.persistent(programs, meta, pre)
                torch.cuda.synchronize()
                err = rel(c.output(), ref)
                t = graph_us(lambda p=programs, m=meta, q=pre: c.persistent(p, m, q), 1, REPS)
                results[f"persistent {per_sm}/SM fill {fill} pre {pre}"] = (t / n, err)
                print(f"persistent{', next tile first' if pre else ''}, {per_sm} a SM, {fill} "
                      f"tiles a program a product: {t / n:.2f} us a GEMV ({t / floor:.3f}x "
                      f"bytes), err {err:.1e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "persistent_gemv_chain.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
