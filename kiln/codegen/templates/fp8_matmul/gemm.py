"""The block-scaled fp8 GEMM, for a region holding kiln::fp8_scaled_mm.

y [M, N] = sum over 128-wide K blocks b of (xq_b @ w_b^T) * xs_b * ws_b: x already
quantised (kiln::fp8_quantize, quantize.py) to e4m3fn with a scale per token and
block, the weight e4m3fn with a scale per 128 x 128 block, fp32 accumulation.

The K loop is the standard block-scaled one (DeepSeek's recipe; BK = 128, so each
step has exactly one scale pair): per step it loads a [BM, 128] x tile and a [128,
BN] weight tile (K-major, as Hopper's fp8 wgmma reads both operands), the BM x
scales of the step and the weight's scale, and adds tl.dot(a, b) times their
product. Nothing else is in the loop, so Triton pipelines the tile loads
(cp.async, `num_stages` deep) and multiplies on wgmma from shared memory. A tile of
at most 128 columns lies in one 128-row weight block: its weight scale is one number
per step; 256-column tiles read two. The scale is applied after each block's
product: the tensor cores' fp8 accumulation is not fp32, so each 128-long product is
promoted into the fp32 accumulator, as in DeepSeek's kernels. Triton then waits for
each wgmma before the promotion; the tensor cores stay busy through other CTAs on
the SM (64 x 128 tiles on 4 warps: 168 registers, three CTAs an SM on sm_90). The
scale loads are issued before the product and used after it (loading them a step
ahead cost that tile 20 registers: two CTAs an SM, not three).

On Hopper and later the tiles come through TMA (`takes_tma`; KILN_FP8_GEMM_TMA=0
turns it off): the x and weight
tensors are passed as descriptors (spec.KernelArg's block), each step's two tiles are
one bulk copy each into shared memory, out-of-bounds rows and K's tail read as zeros,
and the loop holds no address arithmetic: 151 registers against 178 at 64 x 128 on 4
warps (sm_90), a third CTA an SM at 3 stages. Hand-written kernels of both forms on an
H200 (benchmarks/probes/fp8_gemm_forms.py, benchmarks/RESULTS.md 2026-11-29): TMA
0.65-0.98x torch._scaled_mm rowwise against the pointer form's 0.61-0.93x (M 512 and
2048, DeepSeek-V3 and Llama-3-8B widths), faster on every shape; 64 x 128 tiles on 4
warps, 4 stages the best single choice for both (the old 128 x 128 on 8 warps: 0.54-0.68x).
kiln's own kernel (benchmarks/fp8_gemm.py, tune none, H200, 2026-11-29): TMA faster
than its pointer form on all 16 shapes (M 128 / 2048), 0.64-0.82x _scaled_mm at 2048.

Otherwise rows past M and columns past N read row (r mod M) / (c mod N): the loads
need no masks; the store is masked. K's tail block is masked (zeros). Programs are ordered
in groups of GROUP_M row tiles, which read each weight tile in turn while it is in
L2. When the tiles are too few to fill the GPU (a short prompt against a narrow
weight), K is split (kiln.codegen.templates.split_k: the last program of a tile sums
the parts in split order, adds the bias and stores). Targets, gfx942's e4m3fnuz and
the interpreter: common.py.
"""

from __future__ import annotations

import importlib.util

import torch

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import kernel_name, module_source
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.fp8_matmul.analysis import (
    BLOCK,
    SCALED_MM_OP,
    GemmShape,
    analyse_scaled_mm,
)
from kiln.codegen.templates.fp8_matmul.common import (
    combine_splits,
    fnuz_scale,
    fp8_type,
    from_e4m3fn,
    pow2,
)
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of
from kiln.settings import fp8_gemm_tma
from kiln.target import Target

__all__ = ["SCALED_MM_OP", "config_space", "generate", "heuristic", "takes_tma"]

BLOCK_M = (64, 128)  # Hopper's wgmma takes 64 rows per warp group
BLOCK_N = (128, 256)
WARPS = (4, 8)
STAGES = (3, 4, 5)
SPLITS = (1, 16)  # K split caps (the launch picks the count from the tiles)
GROUP_M = 8  # row tiles that take turns on each weight tile while it is in L2
SPLIT_FILL = 2  # programs per SM a split aims for
MIN_SPLIT_BLOCKS = 2  # 128-wide K blocks a split gets at least
_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float32: "tl.float32"}


def config_space(shape: GemmShape) -> list[Config]:
    """Tiles of BM x BN (no BN above N's power of two, but at least 128), warps, stages
    and split caps. Each thread holds the accumulator and one step's product: 4 warps
    up to 64 x 128 tiles, 8 from 128 x 128 (or 64 x 256); larger ones spill."""
    ns = [b for b in BLOCK_N if b <= max(BLOCK_N[0], pow2(shape.n))]
    return [Config.make(w, st, BM=bm, BN=bn, SPLIT_K=sk) for sk in reversed(SPLITS)
            for bm in reversed(BLOCK_M) for bn in ns for w in WARPS for st in STAGES
            if _warps_fit(w, bm, bn)]


def _warps_fit(warps: int, bm: int, bn: int) -> bool:
    return bm * bn // (32 * warps) <= 64  # fp32 values a thread holds per accumulator


def heuristic(target: Target) -> Config:
    """The untuned choice: on Hopper and later 64 x 128 tiles on 4 warps, 4 stages (the
    best single config of both forms on an H200); elsewhere 128 x 128 on 8 warps, 4
    stages (128 KB of shared memory; 3 in gfx942's 64 KB). Splits allowed (used only
    when the tiles leave SMs idle). The interpreter runs the smallest tiles fastest."""
    if target.backend == "interpret":
        return Config.make(4, 1, BM=16, BN=32, SPLIT_K=1)
    if _hopper(target):
        return Config.make(4, 4, BM=64, BN=128, SPLIT_K=16)
    return Config.make(8, 3 if target.backend == "hip" else 4, BM=128, BN=128, SPLIT_K=16)


def takes_tma(target: Target, k: int) -> bool:  # tests force it on the interpreter
    """Whether the tiles come through TMA descriptors: Hopper and later, rows of K
    bytes 16-byte aligned (TMA's stride rule), a Triton with host descriptors
    (>= 3.4), and KILN_FP8_GEMM_TMA not 0."""
    return (_hopper(target) and k % 16 == 0 and fp8_gemm_tma()
            and importlib.util.find_spec("triton.tools.tensor_descriptor") is not None)


def _hopper(target: Target) -> bool:
    return target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The GEMM kernel of `region`; raises CodegenUnsupported saying why not."""
    shape = analyse_scaled_mm(region, plan)
    fp8_type(target)  # declines before any code is emitted
    p = SymbolicArgs(plan.symbols)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    bias_dtype = plan.values[shape.bias].dtype if shape.bias else None
    lines = _body(p, shape, bias_dtype, target)
    name = kernel_name("fp8_gemm", region)
    tunables = ["BM", "BN", "SPLIT_K"]
    params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, set(), target, p.describe())
    tiles = f"cdiv({p.grid(shape.m)}, BM) * cdiv({shape.n}, BN)"
    n_split = split.count("SPLIT_K", tiles, SPLIT_FILL * target.multiprocessors,
                          f"cdiv({shape.k_blocks}, {MIN_SPLIT_BLOCKS})")
    configs = config_space(shape)
    default = heuristic(target)
    if default not in configs:
        configs.insert(0, default)
    meta = {"dtype": str(shape.dtype).replace("torch.", ""),
            "m_hi": bounds_of(shape.m, plan.symbols).hi, "n": shape.n, "k": shape.k,
            "tma": takes_tma(target, shape.k)}
    return KernelSpec(name, source, p.args(), tunables, (tiles, n_split), configs, default,
                      "fp8_gemm", meta, 64 if p.needs_int64 else 32,
                      scratch=split.scratch(tiles, n_split, "BM * BN"))


def _body(p: SymbolicArgs, s: GemmShape, bias_dtype, target: Target) -> list[str]:
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    x_shape = (*s.out_shape[:-1], s.k)
    tma = takes_tma(target, s.k)
    fp8 = torch.float8_e4m3fn
    if tma:  # [BM, 128] and [BN, 128] bulk copies; zeros out of bounds
        xq = p.descriptor(s.xq, fp8, x_shape, ("BM", BLOCK))
        w = p.descriptor(s.weight, fp8, (s.n, s.k), ("BN", BLOCK))
    else:
        xq = p.tensor(s.xq, fp8, x_shape)
    xs = p.tensor(s.xs, torch.float32, (*s.out_shape[:-1], s.k_blocks))
    if not tma:
        w = p.tensor(s.weight, fp8, (s.n, s.k))
    ws = p.tensor(s.scale, torch.float32, (-(-s.n // BLOCK), s.k_blocks))
    bias = p.tensor(s.bias, bias_dtype, (s.n,)) if s.bias else None
    out = p.tensor(s.out, s.dtype, s.out_shape, output=True)
    M = p.dim(s.m)
    tail = s.k % BLOCK != 0
    a_mask = f", mask=rk[None, :] < K - kb * {BLOCK}, other=0.0" if tail else ""
    b_mask = f", mask=rk[:, None] < K - kb * {BLOCK}, other=0.0" if tail else ""
    if tma:
        a = f"{xq}.load([pid_m * BM, kb * {BLOCK}])"
        b = f"{w}.load([pid_n * BN, kb * {BLOCK}]).T"
    else:
        a = from_e4m3fn(f"tl.load(a_ptrs + kb * {BLOCK}{a_mask})", target)
        b = from_e4m3fn(f"tl.load(b_ptrs + kb * {BLOCK}{b_mask})", target)
    fnuz = fnuz_scale(target)
    L = [f"M = {M}", f"N = {s.n}", f"K = {s.k}", f"KB = {s.k_blocks}",
         f"GROUP_M: tl.constexpr = {GROUP_M}",
         f"pid = tl.program_id(0){wide}", "pid_s = tl.program_id(1)",
         "n_split = tl.num_programs(1)",
         "tiles_m = tl.cdiv(M, BM)", "tiles_n = tl.cdiv(N, BN)",
         "# GROUP_M row tiles take turns on each weight tile while it is in L2",
         "in_group = GROUP_M * tiles_n", "first_m = (pid // in_group) * GROUP_M",
         "group_m = tl.minimum(tiles_m - first_m, GROUP_M)",
         "pid_m = first_m + (pid % in_group) % group_m",
         "pid_n = (pid % in_group) // group_m",
         "rm = pid_m * BM + tl.arange(0, BM)", "rn = pid_n * BN + tl.arange(0, BN)",
         "# rows past M / columns past N read row r mod M / c mod N: no load masks",
         "am = rm % M", "wn = rn % N"]  # (TMA: those tiles' rows read as zeros)
    if not tma:
        L += [f"rk = tl.arange(0, {BLOCK})",
              f"a_ptrs = {xq} + am[:, None] * K + rk[None, :]  # [BM, 128] e4m3",
              f"b_ptrs = {w} + wn[None, :] * K + rk[:, None]  # [128, BN] e4m3, K-major"]
    L += [f"as_ptrs = {xs} + am * KB  # [BM] this row's scales",
          f"if BN <= {BLOCK}:  # the tile lies in one 128-row weight block: one scale",
          f"    bs_ptrs = {ws} + (pid_n * BN // {BLOCK}) * KB",
          "else:",
          f"    bs_ptrs = {ws} + (wn // {BLOCK}) * KB",
          "lo = 0", "hi = KB", "if SPLIT_K > 1:  # this split's K blocks",
          "    per_split = tl.cdiv(KB, n_split)", "    lo = pid_s * per_split",
          "    hi = tl.minimum(KB, lo + per_split)",
          "acc = tl.zeros([BM, BN], tl.float32)",
          "for kb in range(lo, hi):",
          f"    a = {a}", f"    b = {b}",
          f"    a_s = tl.load(as_ptrs + kb){fnuz}",
          f"    b_s = tl.load(bs_ptrs + kb){fnuz}",
          "    # each block's product promoted into fp32 with its scale pair",
          f"    if BN <= {BLOCK}:",
          "        acc += tl.dot(a, b, out_dtype=tl.float32) * (a_s * b_s)[:, None]",
          "    else:",
          "        acc += tl.dot(a, b, out_dtype=tl.float32) * (a_s[:, None] * b_s[None, :])",
          "om = rm[:, None]", "on = rn[None, :]", "m_ok = om < M", "n_ok = on < N"]
    L += combine_splits("pid_m * tiles_n + pid_n", "m_ok & n_ok",
                        "n_ok = on < tl.where(last, N, 0)")
    if bias is not None:
        L.append(f"acc += tl.load({bias} + on, mask=n_ok, other=0.0).to(tl.float32)")
    return L + [f"tl.store({out} + om * N + on, acc.to({_TL[s.dtype]}), mask=m_ok & n_ok)"]
