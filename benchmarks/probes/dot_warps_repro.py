"""Does Triton 3.6 compute a [64, K] x [K, N] bf16 dot right on 8 warps at narrow N?
(issue 14: the gated delta kernel's staged form went wrong at 8 warps with 32 columns.)

Each case runs one program: B is either loaded (plain) or an fp32 value made in
registers and cast (as the walker's state: `S.to(bf16)`), optionally carried over a
loop of `steps` dots. Prints the relative error against torch in fp32 per case.

    PYTHONPATH=. [DTYPE=float16] python benchmarks/probes/dot_warps_repro.py
"""

from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl

DTYPE = getattr(torch, os.environ.get("DTYPE", "bfloat16"))  # the interpreter: float16
MODES = [int(x) for x in os.environ.get("MODES", "0,1,2").split(",")]
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


@triton.jit
def _chain(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
           STEPS: tl.constexpr, FROM_REGS: tl.constexpr, BARRIER: tl.constexpr):
    m, k, n = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    s = b.to(tl.float32) * 0.5
    for i in range(STEPS):
        a = tl.load(a_ptr + i * M * K + m[:, None] * K + k[None, :])
        if FROM_REGS == 1:  # the state: an fp32 value cast to the dot's dtype, carried
            s = s + tl.dot(a, s.to(a.dtype), out_dtype=tl.float32)
            if BARRIER:  # as the gated delta walker's chunk count
                tl.debug_barrier()
        elif FROM_REGS == 2:  # a fresh B each step, made in registers (a fused prologue)
            bi = tl.load(b_ptr + k[:, None] * N + n[None, :]).to(tl.float32) * (i + 1.0)
            s = tl.dot(a, bi.to(a.dtype), acc=s, out_dtype=tl.float32)
        else:
            s = tl.dot(a, b, out_dtype=tl.float32)
    tl.store(c_ptr + m[:, None] * N + n[None, :], s)


def reference(a, b, steps, from_regs):
    s = b.float() * 0.5 if from_regs else None
    for i in range(steps):
        if from_regs == 1:
            s = s + a[i].float() @ s.to(a.dtype).float()
        elif from_regs == 2:
            s = s + a[i].float() @ (b.float() * (i + 1.0)).to(a.dtype).float()
        else:
            s = a[i].float() @ b.float()
    return s


def main():
    torch.manual_seed(0)
    cases = itertools.product((16, 32, 64), (4, 8, 16), MODES, (1, 3), (1, 3), (0, 1))
    for n, warps, from_regs, steps, stages, barrier in cases:
        if barrier and from_regs != 1:
            continue
        M = K = 64
        a = (torch.randn(steps, M, K, device=DEVICE) / 8).to(DTYPE)
        b = torch.randn(K, n, device=DEVICE).to(DTYPE)
        c = torch.empty(K, n, device=DEVICE)
        _chain[(1,)](a, b, c, M, K, n, steps, from_regs, barrier, num_warps=warps,
                     num_stages=stages)
        ref = reference(a, b, steps, from_regs)
        err = ((c - ref).norm() / ref.norm()).item()
        print(f"N {n:3d} warps {warps:2d} B {('load', 'regs', 'fresh')[from_regs]} "
              f"steps {steps} stages {stages} barrier {barrier}: rel err {err:.2e}"
              f"{'  WRONG' if err > 2e-2 else ''}", flush=True)


if __name__ == "__main__":
    main()
