"""Probe: the block-scaled fp8 GEMM with two wgmma groups in flight (Gluon), against
torch._scaled_mm rowwise and kiln's Triton form (issue 13's target: >= 0.9x).

kiln's Triton kernel (templates/fp8_matmul/gemm.py) promotes each 128-deep block's
product into the fp32 accumulator with the block's scales, and Triton waits for every
wgmma before that promotion: the warpgroup's tensor cores idle while it multiplies
(0.64-0.86x _scaled_mm at M 2048, benchmarks/RESULTS.md tenth / eleventh sessions).
`tl.dot` cannot say "issue block k+1's product, then promote block k"; Gluon can
(`warpgroup_mma(..., is_async=True)` then `warpgroup_mma_wait(num_outstanding=1)`).

The kernel: one output tile a program (GROUP_M-ordered), a ring of STAGES shared-memory
slots filled by TMA (one mbarrier a slot), each K block's product issued into a fresh
accumulator (use_acc=False), scaled by its x-row and weight-block scales and added into
the fp32 accumulator. IN_FLIGHT says when a product is waited for:
  1  at once (Triton's schedule for this loop)
  2  the previous block's product promoted after this block's is issued, one loop-carried
     product in flight: ptxas serialises every wgmma (C7514: the loop's back edge copies
     the in-flight accumulator), so this form is slower than 1 and kept as the record
  3  unrolled by two, no product in flight across the back edge: block kb promoted while
     kb + 1 multiplies, kb + 1 while kb + 2 does; the promotions pass `acc` through the
     waits, else LLVM sinks the FMAs below the last wait (168 registers, no C7514)

Measured (H200, benchmarks/RESULTS.md 2026-11-30 twentieth session): 3 is no faster
than 1, and both are slower than kiln's Triton TMA form: the promotion's wait is not
what holds the fp8 GEMM at 0.64-0.87x _scaled_mm.

Dev box (no GPU; Triton 3.6 for sm_90): --compile-only prints registers, spills and
shared memory of each config. GPU: PYTHONPATH=.:benchmarks python
benchmarks/probes/fp8_gemm_gluon.py --out g.json [--m 2048] [--shapes q_a,l_gu]
"""

from __future__ import annotations

import argparse
import functools
import json
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

SHAPES = {"q_a": (1536, 7168), "kv_a": (576, 7168), "o": (7168, 16384),
          "sh_gu": (2048, 7168), "sh_down": (7168, 2048), "l_qo": (4096, 4096),
          "l_gu": (14336, 4096), "l_down": (4096, 14336)}
# (BM, BN, warps, stages, in flight); BN 128: one weight scale a block
CONFIGS = [(64, 128, 4, 3, 3), (64, 128, 4, 4, 3), (128, 128, 8, 3, 3), (64, 128, 4, 3, 1),
           (64, 128, 4, 4, 1)]
BK = gl.constexpr(128)


@gluon.constexpr_function
def _mma_layout(bm, bn, warps):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1],
                                     instr_shape=[16, bn, 32])


@gluon.jit
def _fill(a_desc, b_desc, ready, a_ring, b_ring, slot, off_m, off_n, k):
    """One K block's x and weight tiles into `slot`, arriving on its barrier."""
    bar = ready.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_ring.index(slot))
    tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_ring.index(slot))


@gluon.jit
def _product(a_ring, b_ring, ready, kb, STAGES: gl.constexpr, BM: gl.constexpr,
             BN: gl.constexpr, layout: gl.constexpr):
    """Block kb's product, issued (not waited for) once its tiles have arrived."""
    s = kb % STAGES
    mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
    fresh = gl.zeros([BM, BN], gl.float32, layout)  # made here: not held live
    return warpgroup_mma(a_ring.index(s), b_ring.index(s).permute((1, 0)), fresh,
                         use_acc=False, is_async=True)


@gluon.jit
def _two_products(a_ring, b_ring, ready, a_desc, b_desc, xs_rows, ws_row, KB, off_m, off_n,
                  acc, zero, STAGES: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
                  layout: gl.constexpr):
    """IN_FLIGHT 3: blocks kb and kb + 1 issued back to back; block kb promoted while
    kb + 1 multiplies, and kb + 1 (waited for at the iteration's end) promoted while
    kb + 2 multiplies. No product is in flight across the loop's back edge: carrying
    one there copies its registers before its wait, and ptxas then serialises every
    wgmma (C7514). KB even."""
    done_b = zero
    scale_b = gl.zeros_like(gl.load(xs_rows))
    for kb in range(0, KB, 2):
        ta = _product(a_ring, b_ring, ready, kb, STAGES, BM, BN, layout)
        scale_a = gl.load(xs_rows + kb) * gl.load(ws_row + kb)
        acc += done_b * scale_b[:, None]  # block kb - 1, while block kb multiplies
        ta, acc = warpgroup_mma_wait(num_outstanding=1, deps=(ta, acc))  # orders it
        tb = _product(a_ring, b_ring, ready, kb + 1, STAGES, BM, BN, layout)
        scale_b = gl.load(xs_rows + kb + 1) * gl.load(ws_row + kb + 1)
        done_a = warpgroup_mma_wait(num_outstanding=1, deps=(ta,))
        acc += done_a * scale_a[:, None]  # block kb, while block kb + 1 multiplies
        # acc passes through the wait: its promotion is ordered before it (else LLVM
        # sinks the FMAs below the wait and nothing overlaps)
        done_b, acc = warpgroup_mma_wait(num_outstanding=0, deps=(tb, acc))
        if kb + STAGES - 1 < KB:  # the slots of blocks kb and kb + 1 are free now
            _fill(a_desc, b_desc, ready, a_ring, b_ring, (kb + STAGES - 1) % STAGES,
                  off_m, off_n, (kb + STAGES - 1) * BK)
        if kb + STAGES < KB:
            _fill(a_desc, b_desc, ready, a_ring, b_ring, (kb + STAGES) % STAGES,
                  off_m, off_n, (kb + STAGES) * BK)
    return acc + done_b * scale_b[:, None]


@gluon.jit
def gemm_gluon(a_desc, b_desc, xs, ws, out, M, N, KB, XS_M,
               BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
               IN_FLIGHT: gl.constexpr, GROUP_M: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, BN)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = gl.minimum(gl.cdiv(M, BM) - first_m, GROUP_M)
    off_m = (first_m + (pid % in_group) % group_m) * BM
    off_n = ((pid % in_group) // group_m) * BN

    layout: gl.constexpr = _mma_layout(BM, BN, num_warps)
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, layout)
    rm = off_m + gl.arange(0, BM, layout=rows_l)
    xs_rows = xs + (rm % M) * XS_M
    ws_row = ws + (off_n // 128) * KB

    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES - 1):
        if i < KB:
            _fill(a_desc, b_desc, ready, a_ring, b_ring, i, off_m, off_n, i * BK)

    acc = gl.zeros([BM, BN], gl.float32, layout)
    zero = gl.zeros([BM, BN], gl.float32, layout)
    if IN_FLIGHT == 3:
        acc = _two_products(a_ring, b_ring, ready, a_desc, b_desc, xs_rows, ws_row, KB,
                            off_m, off_n, acc, zero, STAGES, BM, BN, layout)
    prev = zero
    if IN_FLIGHT == 2:
        prev = warpgroup_mma_init(zero)  # carried through the loop as an async product
    prev_scale = gl.zeros([BM], gl.float32, rows_l)
    for kb in range(KB if IN_FLIGHT < 3 else 0):
        s = kb % STAGES
        mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
        cur = warpgroup_mma(a_ring.index(s), b_ring.index(s).permute((1, 0)), zero,
                            use_acc=False, is_async=True)
        scale = gl.load(xs_rows + kb) * gl.load(ws_row + kb)
        if IN_FLIGHT == 2:
            # block kb - 1's product is done once at most this one is outstanding
            prev = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
            acc += prev * prev_scale[:, None]
            prev = cur
            prev_scale = scale
        else:
            prev = warpgroup_mma_wait(num_outstanding=0, deps=(cur,))
            acc += prev * scale[:, None]
        nk = kb + STAGES - 1  # refill the slot block kb - 1 read (done by now)
        if nk < KB:
            _fill(a_desc, b_desc, ready, a_ring, b_ring, nk % STAGES, off_m, off_n, nk * BK)
    if IN_FLIGHT == 2:
        prev = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
        acc += prev * prev_scale[:, None]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    rn = off_n + gl.arange(0, BN, layout=cols_l)
    om, on = gl.expand_dims(rm, 1), gl.expand_dims(rn, 0)
    gl.store(out + om * N + on, acc.to(gl.bfloat16), mask=(om < M) & (on < N))


def _smem_layout(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)


def launcher(cfg, xq, xs, wq, ws, out):
    """A no-argument call of the kernel at `cfg` = (BM, BN, warps, stages, in flight)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bm, bn, nw, st, fl = cfg
    (M, K), N = xq.shape, wq.shape[0]
    ad = TensorDescriptor.from_tensor(xq, [bm, BK.value], _smem_layout([bm, BK.value]))
    bd = TensorDescriptor.from_tensor(wq, [bn, BK.value], _smem_layout([bn, BK.value]))
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if fl == 3 and (K // BK.value) % 2:
        raise ValueError("IN_FLIGHT 3 takes an even count of K blocks")
    return lambda: gemm_gluon[(tiles,)](ad, bd, xs, ws, out, M, N, K // BK.value, xs.stride(0),
                                        BM=bm, BN=bn, STAGES=st, IN_FLIGHT=fl, GROUP_M=8,
                                        num_warps=nw)


def compile_only(arch: int, configs) -> None:
    """Each config compiled for sm_`arch` with no GPU: registers, spills, shared bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kiln.codegen.build.compiler import _cuda_registers

    for bm, bn, nw, st, fl in configs:
        sig = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {BK.value}],{_smem_layout([bm, BK.value])!r}>",
               "b_desc": f"tensordesc<fp8e4nv[{bn}, {BK.value}],{_smem_layout([bn, BK.value])!r}>",
               "xs": "*fp32", "ws": "*fp32", "out": "*bf16", "M": "i32", "N": "i32",
               "KB": "i32", "XS_M": "i32", "BM": "constexpr", "BN": "constexpr",
               "STAGES": "constexpr", "IN_FLIGHT": "constexpr", "GROUP_M": "constexpr",
               "num_warps": "constexpr"}
        consts = {"BM": bm, "BN": bn, "STAGES": st, "IN_FLIGHT": fl, "GROUP_M": 8,
                  "num_warps": nw}
        src = GluonASTSource(gemm_gluon, sig, consts)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": nw})
        regs, spills = _cuda_registers(k.asm["cubin"])
        waits = re.findall(r"wgmma.wait_group.sync.aligned (\d+)", k.asm["ptx"])
        print(f"{(bm, bn, nw, st, fl)}: regs {regs} spills {spills} "
              f"shared {k.metadata.shared} B, PTX wgmma waits {waits}", flush=True)


def run(ms, shapes, configs, with_triton: bool) -> list[dict]:
    from fp8_gemm_forms import bench, reference_row
    from fp8_gemm_forms import launcher as triton_launcher

    rows = []
    for M in ms:
        for name in shapes:
            xq, xs, wq, ws, ref, t_ref, flops, out = reference_row(M, name, rows)
            forms = [("gluon", c, functools.partial(launcher, c)) for c in configs]
            if with_triton:  # kiln's form (TMA, 64 x 128 on 4 warps) in the same run
                forms += [("triton_tma", c, functools.partial(triton_launcher, "tma", c, sms=0))
                          for c in [(64, 128, 4, 4), (64, 128, 4, 3)]]
            for form, cfg, make in forms:
                try:
                    fn = make(xq, xs, wq, ws, out)
                    out.zero_()
                    fn()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    t = bench(fn)
                except Exception as e:  # a config this Triton cannot build
                    print(f"   {form} {cfg}: FAIL {str(e)[:300]}", flush=True)
                    continue
                r = {"M": M, "shape": name, "form": form, "cfg": list(cfg), "ms": t,
                     "tflops": flops / t / 1e9, "vs_rowwise": t_ref / t, "err": err}
                rows.append(r)
                print(f"   {form:10s} {cfg} {t * 1e3:.1f} us {r['tflops']:.0f} TF/s "
                      f"ratio {r['vs_rowwise']:.2f} err {err:.1e}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="fp8_gemm_gluon.json")
    ap.add_argument("--m", default="2048")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--no-triton", action="store_true", help="skip kiln's Triton form")
    ap.add_argument("--compile-only", type=int, metavar="ARCH", help="e.g. 90: no GPU")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only(a.compile_only, CONFIGS)
    rows = run([int(m) for m in a.m.split(",")], a.shapes.split(","), CONFIGS, not a.no_triton)
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
