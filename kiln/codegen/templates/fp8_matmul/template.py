"""The fp8 linear in one kernel, for a region holding kiln::fp8_linear: decode's form.

The graph stage keeps kiln::fp8_linear whole only where it has at most a decode step's
tokens (kiln.graph.split_fp8_linear); more tokens run as kiln::fp8_quantize and the
block-scaled GEMM (quantize.py, gemm.py). Here y [M, N] = x [M, K] @ w [N, K]^T with
x's leading dims flattened into M tokens.

Each program computes a [BM, BN] tile of y. Per 128-wide K step it loads the x tile
in x's dtype, takes each row's amax, quantises the tile to e4m3 in registers (x times
448 / amax, scale amax / 448, exactly as kiln.ops.fp8_linear.quantize_activations
does; common.quantise_rows), loads the [BN, 128] fp8 weight tile and the weight's
block scales for its rows, and adds tl.dot(xq, wq^T) (fp8 operands, fp32
accumulation) times the x scales (per row) and the weight scales (per column). With
a few tokens the x tile is small: quantising it once per output tile costs little
beside streaming the weight, and it saves the quantisation kernel's launch. N and K
need not be multiples of 128: the tails are masked, and a scale row serves every
output column of its 128-row weight block.

x, the weight, its scales and the bias are read through the region's index maps by
the expression emitter (a 3-D x is read in place). BK is the quantisation block (128,
fixed); the configs span BM (16 for decode's few tokens up to 128 where the tokens
are unbounded), BN (32-256), num_warps, pipeline stages and, for decode shapes, a K
split (SPLIT_K, the cap of kiln.codegen.templates.split_k's count: the last program
of a tile sums the parts, adds the bias and stores). Targets, gfx942's e4m3fnuz and
the interpreter's fp8 cast: common.py.

The swap form (decode on sm_90) computes the same tile transposed: acc^T [BN, BM] +=
wq [BN, 128] @ xq^T [128, BM]. The weight rows become the dot's M side (64 or 128,
what Hopper's fp8 wgmma needs; with the tokens as M a decode tile has 16 rows and
Triton widens fp8 to fp16 for mma.sync), the few tokens its N side, and the weight
tiles stream through Triton's software pipeline. On an H200 at 4 tokens
(benchmarks/fp8_decode_gemv.py, default configs) it ran Llama-3-8B's gate/up, qkv and
V3's o_proj 12-14% faster than the dot form, and an 8B fp8 decode step at batch 4 fell
from 3.99 to 3.56 ms. At one token the GEMV (gemv.py) stays ahead (gate/up 43 vs 61
us): each K step waits on its x load and quantisation before its wgmma, and one
token's 16-row tile spends that on padding. Loading x a step ahead (Triton pipelines
only the loads a dot reads directly) sped one token 5-17% but slowed four 3-13%, so
it is not done.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.indexing import Lin, Var, linearize, reshape_index
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, mask_of
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.fp8_matmul import gemv
from kiln.codegen.templates.fp8_matmul.analysis import BLOCK, OP, Fp8Shape, analyse
from kiln.codegen.templates.fp8_matmul.common import (
    combine_splits,
    fnuz_scale,
    fp8_type,
    from_e4m3fn,
    pow2,
    quantise_rows,
)
from kiln.codegen.templates.fp8_matmul.folded_norm import FoldedNorm, row_norm
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

__all__ = ["OP", "config_space", "generate", "heuristic"]

BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (32, 64, 128, 256)
WARPS = (4, 8)
STAGES = (2, 3, 4)
SPLITS = (1, 16)  # K split caps for decode shapes (the launch picks the count)
SPLIT_FILL = 4  # programs per SM a split aims for: decode streams the weight
MIN_SPLIT_BLOCKS = 2  # 128-wide K blocks a split gets at least
SWAP_BLOCK_N = (64, 128)  # weight rows a swap-form program takes: wgmma's M side
SWAP_STAGES = (3, 4, 6)
SWAP_MAX_M = 64  # tokens up to which the swap form serves (decode)


def config_space(shape: Fp8Shape, m_hi: int | None = None) -> list[Config]:
    """Tiles of BM tokens by BN output columns, warps and pipeline stages, no BM above
    the tokens there can be (`m_hi`) and no BN above N. 4 warps up to 64 x 128 tiles,
    8 from 64 x 128 to 128 x 128 (or 64 x 256): on sm_90 (bf16 x) 4 warps spilled 72
    registers at 128 x 128, 2 at 128 x 64 and 58 at 64 x 256; 8 warps spilled 60 at
    128 x 256; and 8 warps on a smaller tile idle. Wider N tiles quantise each x tile
    fewer times over the whole product (N / BN programs redo it). Decode shapes (at
    most 64 tokens) may also split K: their few output tiles would leave most SMs idle
    while the weight streams through the rest."""
    ms = [b for b in BLOCK_M if m_hi is None or b <= max(16, pow2(m_hi))]
    ns = [b for b in BLOCK_N if b <= max(32, pow2(shape.n))]
    splits = SPLITS if m_hi is not None and m_hi <= 64 else (1,)
    return [Config.make(w, st, BM=bm, BN=bn, SPLIT_K=sk) for sk in reversed(splits)
            for bm in reversed(ms) for bn in reversed(ns) for w in WARPS for st in STAGES
            if _warps_fit(w, bm, bn)]


def _warps_fit(warps: int, bm: int, bn: int) -> bool:
    if warps == 4:
        return bm <= 64 and bm * bn <= 64 * 128
    return 64 * 128 <= bm * bn <= 128 * 128


def heuristic(shape: Fp8Shape, target: Target, m_hi: int | None = None) -> Config:
    """The untuned choice (timed tuning tries the rest). Decode (a few tokens) reads the
    weight once: 16-token tiles, narrow columns and K split so many programs stream
    it (the split count fills the SMs), deep pipelining. Prefill: 128 x 128 tiles with
    8 warps, as fp8 GEMMs are commonly run on Hopper. The interpreter runs the smallest
    tiles fastest."""
    if target.backend == "interpret":
        return Config.make(4, 1, BM=16, BN=32, SPLIT_K=1)
    if m_hi is not None and m_hi <= 16:
        return Config.make(4, 4, BM=16, BN=64, SPLIT_K=16)
    if m_hi is not None and m_hi <= 64:
        return Config.make(4, 3, BM=max(16, pow2(m_hi)), BN=128, SPLIT_K=16)
    return Config.make(8, 3, BM=128, BN=128, SPLIT_K=1)


def swap_config_space(shape: Fp8Shape, m_hi: int) -> list[Config]:
    """The swap form's tiles: BN weight rows (64 or 128, no more than N needs) by the
    tokens' tile, 4 warps (one warpgroup), 3 to 6 stages, K split caps 16 and 1."""
    ns = [b for b in SWAP_BLOCK_N if b == SWAP_BLOCK_N[0] or b <= pow2(shape.n)]
    return [Config.make(4, st, BM=max(16, pow2(m_hi)), BN=bn, SPLIT_K=sk) for sk in (16, 1)
            for bn in reversed(ns) for st in SWAP_STAGES]


def swap_heuristic(shape: Fp8Shape, target: Target, m_hi: int) -> Config:
    """64 weight rows, 4 stages, K split where the tiles cannot fill the SMs: the
    probe's best or within 5% of it on Llama-3-8B's four projections."""
    return Config.make(4, 4, BM=max(16, pow2(m_hi)), BN=64, SPLIT_K=16)


def takes_swap(target: Target, m_hi: int | None) -> bool:
    """Whether the swap form serves `m_hi` tokens on `target`: decode's token counts on
    GPUs with fp8 wgmma (sm_90)."""
    return (target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
            and m_hi is not None and m_hi <= SWAP_MAX_M)


def _v(name: str, size, block: bool = True) -> Lin:
    return Lin.of(Var(name, size, block))


def generate(region: Region, plan: DispatchPlan, target: Target,
             form: str | None = None) -> KernelSpec:
    """The fp8 GEMM kernel of `region`; raises CodegenUnsupported saying why not.
    `form`: "gemv" (CUDA cores, gemv.py), "dot" (tensor cores, tokens as the dot's
    rows) or "swap" (tensor cores, weight rows as the dot's rows); by default the GEMV
    up to gemv.GEMV_MAX_M tokens, then the swap form up to SWAP_MAX_M where the target
    has fp8 wgmma, else the dot form (benchmarks/fp8_decode_gemv.py compares them)."""
    shape = analyse(region, plan)
    fp8_type(target)  # declines before any code is emitted
    p = SymbolicArgs(plan.symbols)
    em = Emitter(region, plan, p, target)
    norm = row_norm(region, region.anchor(), shape.k)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    m_hi = bounds_of(shape.m, plan.symbols).hi
    form = form or ("gemv" if m_hi is not None and m_hi <= gemv.GEMV_MAX_M
                    else "swap" if takes_swap(target, m_hi) else "dot")
    if form == "swap" and m_hi is None:
        raise CodegenUnsupported("the swap form needs a bound on the tokens")
    if norm is not None and form != "gemv":
        raise CodegenUnsupported(f"a folded RMSNorm needs the GEMV form (at most "
                                 f"{gemv.GEMV_MAX_M} tokens), not the {form} form")
    parts = "2 * BM * BN" if norm is not None else "BM * BN"  # + each row's sum of x^2
    if form == "gemv":
        if m_hi is None:
            raise CodegenUnsupported("the GEMV form needs a bound on the tokens")
        folded = FoldedNorm(norm, em) if norm is not None else None
        lines = gemv.body(em, p, shape, target, m_hi, norm=folded) + epilogue(em, shape)
        tunables, steps = ["BM", "BN", "SPLIT_K", "KB"], f"cdiv({shape.k}, KB * {BLOCK})"
        configs, default = gemv.config_space(shape, m_hi), gemv.heuristic(shape, target, m_hi)
    else:
        swap = form == "swap"
        lines = _body(em, p, shape, target, swap) + epilogue(em, shape)
        tunables, steps = ["BM", "BN", "SPLIT_K"], f"cdiv({shape.k}, {MIN_SPLIT_BLOCKS * BLOCK})"
        configs, default = ((swap_config_space(shape, m_hi), swap_heuristic(shape, target, m_hi))
                            if swap else (config_space(shape, m_hi),
                                          heuristic(shape, target, m_hi)))
    name = kernel_name("fp8_matmul" + ("_rmsnorm" if norm is not None else ""), region)
    params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    tiles = f"cdiv({p.grid(shape.m)}, BM) * cdiv({shape.n}, BN)"
    fill = gemv.SPLIT_FILL if form == "gemv" else SPLIT_FILL
    n_split = split.count("SPLIT_K", tiles, fill * target.multiprocessors, steps)
    grid = (f"cdiv({p.grid(shape.m)}, BM)", f"cdiv({shape.n}, BN)", n_split)
    if default not in configs:
        configs.insert(0, default)
    meta = {"dtype": str(shape.dtype).replace("torch.", ""), "m_hi": m_hi, "n": shape.n,
            "k": shape.k, "form": form, "row_norm": norm is not None}
    return KernelSpec(name, source, p.args(), tunables, grid, configs, default,
                      "fp8_matmul", meta, 64 if p.needs_int64 else 32,
                      scratch=split.scratch(tiles, n_split, parts))


def _body(em: Emitter, p: SymbolicArgs, s: Fp8Shape, target: Target,
          swap: bool = False) -> list[str]:
    """The K loop of the tensor-core forms; `swap` accumulates the tile transposed
    (acc_t [BN, BM]: the weight rows on the dot's M side) and turns it after the loop."""
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    M = p.dim(s.m)
    m_ok, k_ok = Cond("m_ok", frozenset({"om"})), Cond("ok < K", frozenset({"ok"}))
    x_idx = reshape_index((_v("om", s.m), _v("ok", s.k)), (s.m, s.k), s.x_shape)
    w_idx = (_v("wn", s.n), _v("ok", s.k))
    ws_idx = (_v("nb", s.n_blocks), _v("kb", s.k_blocks, False))
    x_mask = mask_of(m_ok, k_ok if s.k % BLOCK else None)
    w_mask = "(wn < N) & (ok < K)" if s.k % BLOCK else "wn < N"
    L = [f"N = {s.n}", f"K = {s.k}",
         f"pid_m = tl.program_id(0){wide}", f"pid_n = tl.program_id(1){wide}",
         "rm = pid_m * BM + tl.arange(0, BM)", "rn = pid_n * BN + tl.arange(0, BN)",
         "om = rm[:, None]  # [BM, 1] tokens", "wn = rn[:, None]  # [BN, 1] weight rows",
         "on = rn[None, :]  # [1, BN] output columns", f"nb = rn // {BLOCK}  # scale rows",
         f"m_ok = om < {M}", "n_ok = on < N",
         "acc_t = tl.zeros([BN, BM], tl.float32)" if swap else
         "acc = tl.zeros([BM, BN], tl.float32)",
         "pid_s = tl.program_id(2)", "n_split = tl.num_programs(2)",
         "lo = 0", "hi = K", "if SPLIT_K > 1:  # this split's whole K blocks",
         *["    " + x for x in split.program_range("K", str(BLOCK))]]
    with em.block() as loop:
        loop += [f"ok = k0 + tl.arange(0, {BLOCK})[None, :]", f"kb = k0 // {BLOCK}"]
        x = em.value(s.x, x_idx, x_mask)
        keep = "m_ok & (ok < K)" if s.k % BLOCK else "m_ok"
        loop += [f"xf = tl.where({keep}, {x.code}.to(tl.float32), 0.0)",
                 "# per token: this K block's scale, and the block quantised in registers",
                 *quantise_rows("xf", target)]
        w = _load_fp8(em, p, s, w_idx, w_mask)
        ws = em.value(s.scale, ws_idx, mask_of(Cond("rn < N", frozenset({"nb"}))))
        loop += [f"wq = {from_e4m3fn(w, target)}", f"ws = {ws.code}{fnuz_scale(target)}"]
        if swap:
            loop.append("acc_t += tl.dot(wq, tl.trans(xq), out_dtype=tl.float32) * "
                        f"ws[:, None] * (xs{fnuz_scale(target)})[None, :]")
        else:
            loop.append("acc += tl.dot(xq, tl.trans(wq), out_dtype=tl.float32) * "
                        f"(xs{fnuz_scale(target)})[:, None] * ws[None, :]")
    L += [f"for k0 in range(lo, hi, {BLOCK}):", *["    " + x for x in loop]]
    if swap:
        L.append("acc = tl.trans(acc_t)  # [BM, BN]")
    return L + combine_splits("pid_m * tl.num_programs(1) + pid_n", "m_ok & n_ok",
                              "n_ok = on < tl.where(last, N, 0)")


def epilogue(em: Emitter, s: Fp8Shape) -> list[str]:
    """The bias and the store of `acc` [BM, BN] at tokens `om`, columns `on` (masks
    `m_ok`, `n_ok`), after any split's combine; both bodies end with these names."""
    L: list[str] = []
    m_ok, n_ok = Cond("m_ok", frozenset({"om"})), Cond("n_ok", frozenset({"on"}))
    if s.bias is not None:
        with em.block() as lines:
            b = em.value(s.bias, (_v("on", s.n),), mask_of(n_ok))
        L += lines + [f"acc += {b.code}.to(tl.float32)"]
    out_idx = reshape_index((_v("om", s.m), _v("on", s.n)), (s.m, s.n), s.out_shape)
    mask = mask_of(m_ok, n_ok)
    with em.block() as store:
        acc = em.let("acc", torch.float32, frozenset({"om", "on"}))
        if s.stored is None:
            em.store(s.out, out_idx, acc, mask, span=("om", "on"))
        else:  # residual adds: to the product rounded to its dtype, as eager adds
            product = em.cast(acc, s.dtype)
            em.overrides[s.out] = lambda index: product if all(
                d == 1 or Lin.of(a).equals(b) for a, b, d in
                zip(index, out_idx, s.out_shape)) else None
            em.store(s.stored, out_idx, em.value(s.stored, out_idx, mask), mask,
                     span=("om", "on"))
    return L + store


def _load_fp8(em: Emitter, p: SymbolicArgs, s: Fp8Shape, index, mask: str) -> str:
    """The [BN, 128] weight tile, read directly (the emitter's masked loads fill with
    the integer 0, which Triton cannot cast to fp8); analyse made sure the weight is a
    region input, contiguous [N, K]."""
    ptr = p.tensor(s.weight, torch.float8_e4m3fn, (s.n, s.k))
    return f"tl.load({ptr} + ({em.code(linearize(index, (s.n, s.k)))}), mask={mask}, other=0.0)"
