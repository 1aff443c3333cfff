"""The fp8 linear for a handful of tokens (decode at batch 1..GEMV_MAX_M): a GEMV on
CUDA cores that streams the weight, one of template.py's two bodies.

A decode step multiplies one to a few token rows by the weight: every weight byte is
used M times, so the kernel is a copy of the weight with a little arithmetic, and what
decides its speed is how many bytes are in flight. The tl.dot form pads the rows to a
16-row tile, widens fp8 to fp16 for mma.sync (Triton has no fp8 MMA for tiles under
64 rows on sm_90) and waits on x's and the scales' loads each 128-wide step; on an
H200 it streamed o_proj (7168 x 16384) at a third of the copy rate.

Here each program owns BN weight rows and a run of K. A step covers KB 128-wide scale
blocks: the weight tile [BN, KB, 128] is one 16-byte load per thread per row, a warp
reading 512 contiguous bytes of a row when KB is 4 (the bf16 GEMV of templates/matmul
streams lm_head at the copy rate the same way: no software pipeline, many warps, all
of a step's loads issued before its arithmetic). Each of the M rows of x is quantised
per 128-block in registers exactly as kiln.ops.fp8_linear.quantize_activations does
(common.quantise_rows), multiplied by the widened weight and summed over the block:
(sum_k xq wq) * xs * ws, the op's per-block product, accumulated per (row, block
column) in fp32 and summed over the step's blocks once, after the loop. Rows past a
dynamic M are skipped. Few output tiles split K (split_k.py) down to one step a split:
the small projections (kv_a: 576 rows) are latency-bound and want every SM.

The arithmetic per weight byte grows with M (a multiply-add per row, and the row's
quantisation), so past GEMV_MAX_M rows the tensor-core form wins. Measured on an H200
(benchmarks/fp8_decode_gemv.py, default configs): at one token this form beat the dot
form on every DeepSeek-V3 shape (o_proj 48 vs 86 us, dense up 64 vs 111 us), at four
it lost on every one (o_proj 230 vs 53 us), so only one-row modules take it.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config
from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.indexing import Lin, Opaque, Var, reshape_index
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, mask_of
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.fp8_matmul.analysis import BLOCK, Fp8Shape
from kiln.codegen.templates.fp8_matmul.common import (
    combine_splits,
    fnuz_scale,
    from_e4m3fn,
    pow2,
    quantise_rows,
)
from kiln.target import Target

GEMV_MAX_M = 1  # most tokens the CUDA-core form takes (decode at batch 1)
BLOCK_N = (32, 64, 128)
STEP_BLOCKS = (1, 2, 4)  # KB: 128-wide K blocks a step loads per row
WARPS = (4, 8)
ROW_BYTES = 16  # a thread's load per weight row: one 128-bit vector


def rows(m_hi: int) -> int:
    """BM: the accumulator tile's rows, a power of two holding every token."""
    return pow2(m_hi)


def config_space(shape: Fp8Shape, m_hi: int) -> list[Config]:
    """BN weight rows by KB blocks a step, 4 or 8 warps, K split caps 16 and 1. A
    thread holds BN * KB * 128 / threads weight bytes a step: 64 to 256 (4 to 16
    16-byte loads in flight); fewer starve the memory system, more spill."""
    ns = [b for b in BLOCK_N if b <= max(32, pow2(shape.n))]
    kbs = [b for b in STEP_BLOCKS if b == 1 or b * BLOCK <= pow2(shape.k)]
    out = []
    for sk in (16, 1):
        for bn in reversed(ns):
            for kb in reversed(kbs):
                for w in WARPS:
                    per_thread = bn * kb * BLOCK // (32 * w)
                    if 64 <= per_thread <= 256 or (bn, kb) == (ns[0], kbs[0]):
                        out.append(Config.make(w, 1, BM=rows(m_hi), BN=bn, SPLIT_K=sk, KB=kb))
    return list(dict.fromkeys(out))


def heuristic(shape: Fp8Shape, target: Target, m_hi: int) -> Config:
    """32 rows by 4 blocks (a warp reads 512 contiguous bytes of a row; a thread 8
    16-byte vectors a step), 4 warps, K split where the tiles cannot fill the machine.
    On sm_90 (bf16 x, one token) that is 96 registers, five programs an SM: o_proj's
    448 programs all resident; 64 rows took 167 registers (three an SM: two waves).
    Two or more tokens keep the widened step for every row: 2 blocks (128-161
    registers; 4 blocks took 254).
    The interpreter runs the smallest tile fastest."""
    if target.backend == "interpret":
        return Config.make(4, 1, BM=rows(m_hi), BN=32, SPLIT_K=1, KB=1)
    kb = 4 if m_hi == 1 and shape.k >= 4 * BLOCK else 2 if shape.k >= 2 * BLOCK else 1
    return Config.make(4, 1, BM=rows(m_hi), BN=32, SPLIT_K=16, KB=kb)


def _v(name: str, size) -> Lin:
    return Lin.of(Var(name, size, True))


def body(em: Emitter, p: SymbolicArgs, s: Fp8Shape, target: Target, m_hi: int) -> list[str]:
    """The kernel's lines (template.generate wraps them): the K loop over steps of KB
    blocks, every token row's products, the split combine, bias and store."""
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    M = p.dim(s.m)
    dynamic = not (isinstance(s.m, int) and s.m == m_hi)
    L = [f"N = {s.n}", f"K = {s.k}", f"pid_n = tl.program_id(1){wide}",
         "rn = pid_n * BN + tl.arange(0, BN)",
         "wn = rn[:, None, None]  # [BN, 1, 1] weight rows",
         f"kx = tl.arange(0, KB)[None, :, None] * {BLOCK} + "
         f"tl.arange(0, {BLOCK})[None, None, :]  # [1, KB, 128] a step's K offsets",
         f"sn = (rn // {BLOCK})[:, None]  # [BN, 1] scale rows",
         "pid_s = tl.program_id(2)", "n_split = tl.num_programs(2)",
         "lo = 0", "hi = K", "if SPLIT_K > 1:  # this split's whole steps",
         *["    " + x for x in split.program_range("K", f"KB * {BLOCK}")],
         *[f"acc{m} = tl.zeros([BN, KB], tl.float32)" for m in range(m_hi)],
         *[f"row{m} = tl.minimum({m}, {M} - 1)" for m in range(m_hi) if dynamic]]
    x_mask = mask_of(Cond("kk < K", frozenset({"kk"})))
    with em.block() as loop:
        loop += ["kk = k0 + kx", f"kb = k0 // {BLOCK} + tl.arange(0, KB)[None, :]  # [1, KB]"]
        products = []
        for m in range(m_hi):
            # a row past a dynamic M reads row M - 1 (valid memory); its products are skipped
            at = Lin.of(Opaque(f"row{m}", s.m)) if dynamic else Lin.of(m)
            x = em.value(s.x, reshape_index((at, _v("kk", s.k)), (s.m, s.k), s.x_shape), x_mask)
            loop += [f"xf = tl.where(kk < K, {x.code}.to(tl.float32), 0.0)",
                     *quantise_rows("xf", target, axis=2),
                     f"xq{m} = xq.to(tl.float32)", f"xs{m} = xs{fnuz_scale(target)}"]
            step = [f"acc{m} += tl.sum(xq{m} * wf, 2) * xs{m} * ws  # [BN, KB]"]
            products += [f"if {m} < {M}:", "    " + step[0]] if dynamic and m else step
        w = _load_fp8(em, p, s)
        ws = em.value(s.scale, (_v("sn", s.n_blocks), _v("kb", s.k_blocks)),
                      mask_of(Cond(f"(sn < {s.n_blocks}) & (kb < {s.k_blocks})",
                                   frozenset({"sn", "kb"}))))
        # the weight's load after x's: Triton's layout propagation (a worklist) gives the
        # products the layout of the last anchor; were x's last, the weight tile would
        # go through shared memory to reach it
        loop += [f"ws = {ws.code}{fnuz_scale(target)}",
                 f"wf = {from_e4m3fn(w, target)}.to(tl.float32)", *products]
    L += [f"for k0 in range(lo, hi, KB * {BLOCK}):", *["    " + x for x in loop],
          "rm = tl.arange(0, BM)", "om = rm[:, None]  # [BM, 1] tokens",
          "on = rn[None, :]  # [1, BN] output columns", f"m_ok = om < {M}", "n_ok = on < N",
          "acc = tl.zeros([BM, BN], tl.float32)",
          *[f"acc = tl.where(om == {m}, tl.sum(acc{m}, 1)[None, :], acc)"
            for m in range(m_hi)]]
    return L + combine_splits("pid_n", "m_ok & n_ok", "n_ok = on < tl.where(last, N, 0)")


def _load_fp8(em: Emitter, p: SymbolicArgs, s: Fp8Shape) -> str:
    """A step's [BN, KB, 128] weight tile (e4m3fn bytes, 16 to a thread's vector)."""
    ptr = p.tensor(s.weight, torch.float8_e4m3fn, (s.n, s.k))
    at = "wn.to(tl.int64)" if p.needs_int64 else "wn"
    return f"tl.load({ptr} + ({at} * K + kk), mask=(wn < N) & (kk < K), other=0.0)"
