"""The grouped MoE GEMM: one Triton launch for a region holding kiln::moe_experts.

The op (kiln.ops.moe_experts) runs each token's k chosen experts (SwiGLU) and sums
their outputs by the routing weights. Which expert gets how many tokens is known only
on the device, so the kernel sorts the N * k (token, expert) pairs by expert itself,
into buffers of static size N * k (an expert has at most every pair), and runs every
expert's rows as one grouped GEMM: each expert's weights are read once per BM-row tile
of its rows, all experts in the same launch, whatever the counts.

One launch holds four kinds of programs. Each program takes a ticket from an atomic
counter when it starts, and its ticket says its role (body.py writes them):

- routers, one per 32 tokens: each valid pair takes the next row of its expert (an
  atomic count per expert) and writes its pair id there; a token with no valid choice
  gets zero output rows;
- gate/up programs, one per (tile, BN intermediate columns): once every router is
  done, the experts' counts give the tiles (BM rows each, numbered expert by expert);
  the tile's tokens are gathered from x (through its views), multiplied by BN rows of
  the expert's gate and up (x read once for both), and silu(gate) * up is stored in
  the tile's rows of a buffer [N * k, I];
- down programs, one per (tile, BD output columns): once the tile's gate/up column
  blocks are all stored, its rows times BD rows of the expert's down, times each
  pair's routing weight, are stored at the pair's row of a buffer [N * k, dim];
- the combine is no separate role: each down program counts its rows' arrivals per
  (token, column block), and the program that brings a token's last pair sums the
  token's k rows in the order of j (fp32) and stores y. Deterministic: no float
  atomics, and the sum's order does not depend on which program came last.

Deadlock-free by the tickets: a program only waits for work of smaller tickets
(routers before gate/up before down), taken by programs already running, which never
wait for a larger ticket. Work items past the tiles the routing made (the grid is
sized for the bound, min(N * k, cdiv(N * k, BM) + E) tiles) find nothing to do. The
last program to finish zeroes the counters for the next launch.

Configs: BM rows per tile (16 for decode), BN gate/up columns (two accumulators) with
BD = 2 * BN down columns (one), BK reduction step, warps for the accumulators, 2-4
pipeline stages. build/resources.py has its shared-memory model.

kiln::moe_experts_fp8 (e4m3 experts with 128 x 128 block scales) is the same launch
with fp8 K loops (fp8.py: activations quantised per row and 128-block in the
kernel, e4m3 tl.dot, the block scales applied per 128-wide K step); it declines
where Triton has no e4m3 (before sm_89), and the op runs as its PyTorch form. Up to
fp8_gemv.GEMV_MAX_TOKENS tokens (decode) its K loops are GEMVs on CUDA cores instead
(fp8_gemv.py: the weights streamed as 16-byte loads, no tl.dot), the rest the same.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config, KernelSpec, Scratch
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.kernel_args import INT32_MAX, SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.fp8_matmul.common import fp8_type
from kiln.codegen.templates.moe import fp8_gemv
from kiln.codegen.templates.moe.analysis import FP8_OP, OP, MoeShape, analyse
from kiln.codegen.templates.moe.body import BT, COUNTS, SCRATCH, MoeBody
from kiln.codegen.templates.moe.fp8 import Fp8MoeBody
from kiln.codegen.templates.moe.fp8_gemv import Fp8MoeGemvBody
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

__all__ = ["FP8_OP", "OP", "config_space", "generate", "heuristic"]

ROWS = (16, 32, 64, 128)
COLUMNS = (64, 128)  # BN; BD is twice it
STEPS = {64: (3, 4), 128: (2, 3)}  # BK -> pipeline stages
FP8_STEPS = {128: (2, 3, 4)}  # fp8 experts: a K step is one 128-wide scale block
DECODE_PAIRS = 64  # at most this many pairs: decode, bound by reading the weights


def config_space(shape: MoeShape, pairs_hi: int | None) -> list[Config]:
    """Tiles of BM rows (none above the pairs there can be) by BN gate/up columns and
    BD = 2 * BN down columns, K steps with their stages, largest first. 4 warps up to
    64 x 64 tiles, 8 above; 128 x 128 (two 128 x 128 fp32 accumulators) is left out."""
    top = max(16, _pow2(pairs_hi)) if pairs_hi is not None else ROWS[-1]
    steps = FP8_STEPS if shape.fp8 else STEPS
    configs = []
    for bm in reversed([b for b in ROWS if b <= top]):
        for bn in reversed(COLUMNS):
            if bm * bn > 128 * 64:
                continue
            for bk, stages in steps.items():
                for st in stages:
                    configs.append(_config(bm, bn, bk, st, shape.fp8))
    return configs


def _config(bm: int, bn: int, bk: int, stages: int, fp8: bool = False) -> Config:
    """4 warps up to 64 x 64 tiles, 8 above; fp8 experts up to 32 x 64 (on sm_90, 4
    warps spilled at 64 x 64, 32 x 128 and 16 x 128: the quantised x tile and each
    step's product beside the accumulators)."""
    few = bm <= 32 and bn <= 64 if fp8 else bm * bn <= 64 * 64
    warps = 4 if few else 8
    return Config.make(warps, stages, BM=bm, BN=bn, BD=2 * bn, BK=bk)


def heuristic(shape: MoeShape, target: Target, pairs_hi: int | None) -> Config:
    """The untuned choice. Decode (a few pairs) streams the chosen experts' weights:
    16-row tiles, 64 gate/up columns so many programs share the reading, long K steps.
    Prefill: 64-row tiles (V3's 2048-token prefill gives an expert 64 pairs on
    average) by 128 columns, 8 warps. fp8 experts step K by 128 (their scale block).
    The interpreter runs small tiles fastest, but for fp8 experts 64 / 128 columns
    (half the programs, each quantising its x tile again: 8 s, not 11, for the tests')."""
    if target.backend == "interpret":
        return Config.make(4, 1, BM=16, BN=64, BD=128, BK=128) if shape.fp8 else \
            Config.make(4, 1, BM=16, BN=32, BD=32, BK=32)
    if pairs_hi is not None and pairs_hi <= DECODE_PAIRS:
        return _config(16, 64, 128, 3, shape.fp8)
    return _config(64, 128, 128 if shape.fp8 else 64, 3, shape.fp8)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def generate(region: Region, plan: DispatchPlan, target: Target,
             form: str | None = None) -> KernelSpec:
    """The grouped MoE kernel of `region`; raises CodegenUnsupported saying why not.
    `form` (fp8 experts): "gemv" (CUDA cores, fp8_gemv.py) or "dot" (tensor cores);
    by default the GEMV up to fp8_gemv.GEMV_MAX_TOKENS tokens (benchmarks compare)."""
    shape = analyse(region, plan)
    if shape.fp8:
        fp8_type(target)  # declines where Triton has no e4m3, before any code is emitted
    pairs_hi = bounds_of(shape.pairs, plan.symbols).hi
    tokens_hi = bounds_of(shape.tokens, plan.symbols).hi
    form = form or ("gemv" if shape.fp8 and tokens_hi is not None
                    and tokens_hi <= fp8_gemv.GEMV_MAX_TOKENS else "dot")
    if form == "gemv" and (not shape.fp8 or tokens_hi is None):
        raise CodegenUnsupported("the GEMV form needs fp8 experts and a bound on the tokens")
    if pairs_hi is not None and pairs_hi > INT32_MAX:
        raise CodegenUnsupported(f"up to {pairs_hi} (token, expert) pairs: row ids are int32")
    p = SymbolicArgs(plan.symbols)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    for extent in (shape.pairs * shape.experts, shape.pairs * shape.inter,
                   shape.pairs * shape.dim):
        p.check_extent(extent)  # the scratch buffers
    em = Emitter(region, plan, p, target)
    body = Fp8MoeGemvBody if form == "gemv" else Fp8MoeBody if shape.fp8 else MoeBody
    lines = body(em, p, shape).lines()
    name = kernel_name("moe_fp8" if shape.fp8 else "moe", region)
    tunables = ["BM", "BN", "BD", "KB" if form == "gemv" else "BK"]
    params = p.names() + list(SCRATCH) + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    n = f"({p.grid(shape.tokens)})"
    pairs = f"{n} * {shape.top_k}"
    tiles = f"min({pairs}, cdiv({pairs}, BM) + {shape.experts})"
    grid = (f"cdiv({n}, {BT}) + {tiles} * (cdiv({shape.inter}, BN) + "
            f"cdiv({shape.dim}, BD))",)
    if form == "gemv":
        configs = fp8_gemv.config_space(shape, tokens_hi)
        default = fp8_gemv.heuristic(target, tokens_hi)
    else:
        configs, default = config_space(shape, pairs_hi), heuristic(shape, target, pairs_hi)
    if default not in configs:
        configs.insert(0, default)
    meta = {"dtype": str(shape.dtype).replace("torch.", ""), "pairs_hi": pairs_hi,
            "experts": shape.experts, "top_k": shape.top_k, "inter": shape.inter,
            "dim": shape.dim, "form": form,
            # timed with each token choosing k different experts at random: zeros
            # would send every pair to expert 0 and time one expert's GEMM
            "timing_fill": {shape.ids: {"choose_from": str(shape.experts)}}}
    return KernelSpec(name, source, p.args(), tunables, grid, configs, default,
                      "moe_fp8" if shape.fp8 else "moe", meta,
                      64 if p.needs_int64 else 32,
                      scratch=_scratch(shape, n, pairs, tiles))


def _scratch(shape: MoeShape, n: str, pairs: str, tiles: str) -> list[Scratch]:
    """body.SCRATCH's buffers: counters, each expert's pair ids, the two row buffers."""
    ctr, rows, h, o = SCRATCH
    return [Scratch(ctr, torch.int32, f"{COUNTS} + {shape.experts} + {tiles} + "
                    f"{n} * cdiv({shape.dim}, BD)", zeroed=True),
            Scratch(rows, torch.int32, f"{shape.experts} * {pairs}"),
            Scratch(h, shape.dtype, f"{pairs} * {shape.inter}"),
            Scratch(o, shape.dtype, f"{pairs} * {shape.dim}")]
