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
column) in fp32 and summed over the step's blocks once, after the loop. On NVIDIA
GPUs the product itself is packed fp16 through inline PTX (packed_product.py: the weight
read as 4-byte words, ~1.5 instructions a byte instead of ~3). Rows past a
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
from kiln.codegen.templates.fp8_matmul import packed_product as packed
from kiln.codegen.templates.fp8_matmul.analysis import BLOCK, Fp8Shape
from kiln.codegen.templates.fp8_matmul.common import (
    combine_splits,
    fnuz_scale,
    from_e4m3fn,
    pow2,
    quantise_rows,
)
from kiln.dispatch.group_fp8_siblings import FP8_GEMV_MAX_M
from kiln.target import Target

# most tokens the CUDA-core form takes (decode at batch 1); grouping reads it too
GEMV_MAX_M = FP8_GEMV_MAX_M
BLOCK_N = (32, 64, 128)
STEP_BLOCKS = (1, 2, 4)  # KB: 128-wide K blocks a step loads per row
WARPS = (4, 8)
ROW_BYTES = 16  # a thread's load per weight row: one 128-bit vector
# programs an SM the K split aims for (the dot forms': template.SPLIT_FILL, 4). A program
# runs its steps one after another, each step's loads issued after the last one's
# arithmetic: few splits leave Llama's w2 (128 tiles of 32 rows) 4 programs of 7 steps
# an SM, at 1.4x its bytes' time on an H200 where w13 (896 tiles) ran at 1.09x. The
# packed form's 72-91 registers hold 5-7 programs an SM.
SPLIT_FILL = 8
SHORT_K = 4096  # one token's K up to which the default step is 2 blocks, not 4


def rows(m_hi: int) -> int:
    """BM: the accumulator tile's rows, a power of two holding every token."""
    return pow2(m_hi)


def config_space(shape: Fp8Shape, m_hi: int, streams: int = 1) -> list[Config]:
    """BN weight rows by KB blocks a step, 4 or 8 warps, K split caps 16 and 1. A
    thread holds streams * BN * KB * 128 / threads weight bytes a step (`streams`:
    the weights a program reads, two for paired siblings): 64 to 256 (4 to 16 16-byte
    loads in flight); fewer starve the memory system, more spill."""
    ns = [b for b in BLOCK_N if b <= max(32, pow2(shape.n))]
    kbs = [b for b in STEP_BLOCKS if b == 1 or b * BLOCK <= pow2(shape.k)]
    out = []
    for sk in (16, 1):
        for bn in reversed(ns):
            for kb in reversed(kbs):
                for w in WARPS:
                    per_thread = streams * bn * kb * BLOCK // (32 * w)
                    if 64 <= per_thread <= 256 or (bn, kb) == (ns[0], kbs[0]):
                        out.append(Config.make(w, 1, BM=rows(m_hi), BN=bn, SPLIT_K=sk, KB=kb))
    return list(dict.fromkeys(out))


def heuristic(shape: Fp8Shape, target: Target, m_hi: int, streams: int = 1) -> Config:
    """32 rows by 4 blocks (a warp reads 512 contiguous bytes of a row; a thread 8
    16-byte vectors a step), 4 warps, K split where the tiles cannot fill the machine.
    On sm_90 (bf16 x, one token) that is 96 registers, five programs an SM: o_proj's
    448 programs all resident; 64 rows took 167 registers (three an SM: two waves).
    Two or more tokens keep the widened step for every row: 2 blocks (128-161
    registers; 4 blocks took 254). Two weights a program (paired siblings) take half
    the blocks each: the same bytes a thread a step. One token at K <= SHORT_K takes 2
    blocks too: the fast tuner picked 2 for Llama-3-8B's qkv, o and gate/up (K 4096;
    H200, its timing: 16.5 -> 15.7, 13.9 -> 11.6, 43.5 -> 43.2 us) and kept 4 for down
    (K 14336: 25.1 against 26.5 us at 2).
    The interpreter runs the smallest tile fastest."""
    if target.backend == "interpret":
        return Config.make(4, 1, BM=rows(m_hi), BN=32, SPLIT_K=1, KB=1)
    long_k = m_hi == 1 and shape.k > SHORT_K
    kb = 4 if long_k else 2 if shape.k >= 2 * BLOCK else 1
    kb = max(1, kb // streams)
    return Config.make(4, 1, BM=rows(m_hi), BN=32, SPLIT_K=16, KB=kb)


def _v(name: str, size) -> Lin:
    return Lin.of(Var(name, size, True))


def tile(j: int) -> str:
    """The name of stream j's [BM, BN] tile after the loop ("acc" for the first)."""
    return "acc" if j == 0 else f"acc_s{j}"


def _names(j: int) -> tuple[str, str, str]:
    """Stream j's row accumulator prefix, widened weight step and step scales."""
    return ("acc", "wf", "ws") if j == 0 else (f"acc_s{j}_", f"wf_s{j}", f"ws_s{j}")


def k_tail(s: Fp8Shape) -> bool:
    """Whether a step may pass K (then its loads are masked): K not a multiple of the
    widest step. V3's and Llama's K all are; unmasked, the grouped GEMV's loop took 96
    registers on sm_90, not 128."""
    return s.k % (STEP_BLOCKS[-1] * BLOCK) != 0


def plain_weight(em: Emitter, p: SymbolicArgs, s: Fp8Shape, target: Target
                 ) -> list[tuple[str, str]]:
    """The one weight of a plain fp8 linear: its step tile's load and its step
    scales' (read through their index map), the loop's lines emitted into `em`."""
    ok = f"(sn < {s.n_blocks}) & (kb < {s.k_blocks})" if k_tail(s) else f"sn < {s.n_blocks}"
    ws = em.value(s.scale, (_v("sn", s.n_blocks), _v("kb", s.k_blocks)),
                  mask_of(Cond(ok, frozenset({"sn", "kb"}))))
    return [(_load_fp8(em, p, s, target), ws.code)]


def body(em: Emitter, p: SymbolicArgs, s: Fp8Shape, target: Target, m_hi: int,
         columns: list[str] | None = None, weights=None, tile_id: str = "pid_n",
         norm=None) -> list[str]:
    """The kernel's lines (template.generate wraps them): the K loop over steps of KB
    blocks, every token row's products, the split combine; the bias and store follow.

    A grouped form (grouped.py) passes `columns`, the lines setting `N` and the column
    block `pid_n` (by default s.n and the grid's); `weights(em)`, called in the loop,
    the (weight step load, step scales) code of each weight the program streams (by
    default plain_weight's), each into its own tile (`tile(j)`); and `tile_id`, the
    program's scratch slot when K is split. x is loaded and quantised once a step for
    all of them. `norm`: an RMSNorm folded in (folded_norm.FoldedNorm): x * w is
    quantised, x^2 summed beside (a [BM, BN] tile `ssq` combined with the parts), and
    the sums scaled per row after the combine."""
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    M = p.dim(s.m)
    dynamic = not (isinstance(s.m, int) and s.m == m_hi)
    columns = columns or [f"N = {s.n}", f"pid_n = tl.program_id(1){wide}"]
    pk = packed.packs(target, k_tail(s))
    L = [*columns, f"K = {s.k}",
         "rn = pid_n * BN + tl.arange(0, BN)",
         "wn = rn[:, None, None]  # [BN, 1, 1] weight rows",
         f"kx = tl.arange(0, KB)[None, :, None] * {BLOCK} + "
         f"tl.arange(0, {BLOCK})[None, None, :]  # [1, KB, 128] a step's K offsets",
         *([packed.word_offsets()] if pk else []),
         f"sn = (rn // {BLOCK})[:, None]  # [BN, 1] scale rows",
         "pid_s = tl.program_id(2)", "n_split = tl.num_programs(2)",
         "lo = 0", "hi = K", "if SPLIT_K > 1:  # this split's whole steps",
         *["    " + x for x in split.program_range("K", f"KB * {BLOCK}")],
         *[f"row{m} = tl.minimum({m}, {M} - 1)" for m in range(m_hi) if dynamic]]
    with em.block() as loop:
        loop += ["kk = k0 + kx", *(["kq = k0 // 4 + kw"] if pk else []),
                 f"kb = k0 // {BLOCK} + tl.arange(0, KB)[None, :]  # [1, KB]"]
        n = len(loop)
        streams = (weights or (lambda e: plain_weight(e, p, s, target)))(em)
        # packed: the scales' loads (just emitted) and x's arithmetic go after the words'
        # loads (below); only x's loads precede them
        later, loop[n:] = (loop[n:], []) if pk else ([], loop[n:])
        after_words = _rows_of_x(em, s, target, m_hi, dynamic, norm, pk)
        if pk:
            # the words' loads after x's (the last anchor's layout is the products': x's
            # pairs go to it, not the words to x), before the scales' and x's arithmetic:
            # the scales' layout conversion and x's reductions wait on their loads at
            # barriers, and a load cannot pass bar.sync
            loop += [f"{_names(j)[1]} = {w}" for j, (w, _) in enumerate(streams)]
            loop += later + after_words
        # the weight's load after x's: Triton's layout propagation (a worklist) gives the
        # products the layout of the last anchor; were x's last, the weight tile would
        # go through shared memory to reach it
        for j, (w, scale) in enumerate(streams):
            _, wf, ws = _names(j)
            loop += [f"{ws} = {scale}{fnuz_scale(target)}",
                     *([] if pk else [f"{wf} = {from_e4m3fn(w, target)}.to(tl.float32)"])]
        loop += _products(len(streams), m_hi, M, dynamic, pk, target)
    L += [f"{_names(j)[0]}{m} = tl.zeros([BN, KB], tl.float32)"
          for j in range(len(streams)) for m in range(m_hi)]
    if norm is not None:
        L += [f"ss{m} = tl.zeros([1, KB], tl.float32)" for m in range(m_hi)]
    L += [f"for k0 in range(lo, hi, KB * {BLOCK}):", *["    " + x for x in loop]]
    return L + _tiles(len(streams), m_hi, M, tile_id, norm)


def _rows_of_x(em: Emitter, s: Fp8Shape, target: Target, m_hi: int, dynamic: bool, norm,
               pk: bool) -> list[str]:
    """Each token row's x step read (and its squares summed for a folded norm) and
    quantised, into the emitter's block, row after row; the packed form's arithmetic is
    returned instead, to go after the weight words' loads. A row past a dynamic M reads
    row M - 1 (valid memory); its products are skipped."""
    tail = k_tail(s)
    x_mask = mask_of(Cond("kk < K", frozenset({"kk"})) if tail else None)
    after_words = []
    for m in range(m_hi):
        at = Lin.of(Opaque(f"row{m}", s.m)) if dynamic else Lin.of(m)
        if norm is not None:
            norm.mask = x_mask
        x = em.value(s.x, reshape_index((at, _v("kk", s.k)), (s.m, s.k), s.x_shape), x_mask)
        xf = (f"tl.where(kk < K, {x.code}.to(tl.float32), 0.0)" if tail else
              f"tl.broadcast_to({x.code}.to(tl.float32), [1, KB, {BLOCK}])")
        squares = [] if norm is None else [norm.squares(f"ss{m}", "kk < K" if tail else None,
                                                        f"[1, KB, {BLOCK}]")]
        if pk:
            after_words += [f"xf{m} = {xf}", *squares,
                            *packed.quantise_packed(f"xf{m}", m, target)]
            continue
        em.lines += [*squares, f"xf = {xf}", *quantise_rows("xf", target, axis=2),
                     f"xq{m} = xq.to(tl.float32)", f"xs{m} = xs{fnuz_scale(target)}"]
    return after_words


def _products(streams: int, m_hi: int, M: str, dynamic: bool, pk: bool,
              target: Target) -> list[str]:
    """Each stream's block products with each row, into the row's [BN, KB] accumulator
    (skipped for rows past a dynamic M)."""
    out = []
    for j in range(streams):
        acc, wf, ws = _names(j)
        for m in range(m_hi):
            prod = packed.product(wf, m, target) if pk else [f"prod = xq{m} * {wf}"]
            step = [*prod, f"{acc}{m} += tl.sum(prod, 2) * xs{m} * {ws}  # [BN, KB]"]
            out += [f"if {m} < {M}:", *["    " + x for x in step]] if dynamic and m else step
    return out


def _tiles(streams: int, m_hi: int, M: str, tile_id: str, norm) -> list[str]:
    """After the loop: each stream's [BM, BN] tile of row sums, the split combine, and a
    folded norm's row scale."""
    L = ["rm = tl.arange(0, BM)", "om = rm[:, None]  # [BM, 1] tokens",
         "on = rn[None, :]  # [1, BN] output columns", f"m_ok = om < {M}", "n_ok = on < N"]
    for j in range(streams):
        L += [f"{tile(j)} = tl.zeros([BM, BN], tl.float32)",
              *[f"{tile(j)} = tl.where(om == {m}, tl.sum({_names(j)[0]}{m}, 1)[None, :], "
                f"{tile(j)})" for m in range(m_hi)]]
    accs = [tile(j) for j in range(streams)]
    if norm is None:
        return L + combine_splits(tile_id, "m_ok & n_ok", "n_ok = on < tl.where(last, N, 0)",
                                  accs)
    L += ["ssq = tl.zeros([BM, BN], tl.float32)  # each row's sum of x^2, at every column",
          *[f"ssq = tl.where(om == {m}, tl.sum(ss{m}, 1)[:, None], ssq)" for m in range(m_hi)]]
    return (L + combine_splits(tile_id, "m_ok & n_ok", "n_ok = on < tl.where(last, N, 0)",
                               accs + ["ssq"]) + norm.scale("ssq", accs))


def _load_fp8(em: Emitter, p: SymbolicArgs, s: Fp8Shape, target: Target) -> str:
    """A step's [BN, KB, 128] weight tile (e4m3fn bytes, 16 to a thread's vector)."""
    ptr = p.tensor(s.weight, torch.float8_e4m3fn, (s.n, s.k))
    return weight_step(ptr, p, s, target)


def weight_step(ptr: str, p: SymbolicArgs, s: Fp8Shape, target: Target) -> str:
    """The step's weight tile at rows `wn`, columns `kk` of the [N, K] weight at `ptr`;
    in the packed form its [BN, KB, 32] 4-byte words at word columns `kq`."""
    at = "wn.to(tl.int64)" if p.needs_int64 else "wn"
    if packed.packs(target, k_tail(s)):
        return (f"tl.load(({ptr}).to(tl.pointer_type(tl.int32)) + ({at} * (K // 4) + kq), "
                "mask=wn < N, other=0)")
    ok = "(wn < N) & (kk < K)" if k_tail(s) else "wn < N"
    return f"tl.load({ptr} + ({at} * K + kk), mask={ok}, other=0.0)"


def scale_step(ptr: str, n_blocks: str, s: Fp8Shape) -> str:
    """The step's [BN, KB] block scales of rows `sn` from the [NB, KB] scales at `ptr`
    (a grouped form's: `n_blocks` may be its program's sibling's)."""
    kb = s.k_blocks
    ok = f"(sn < {n_blocks}) & (kb < {kb})" if k_tail(s) else f"sn < {n_blocks}"
    return f"tl.load({ptr} + sn * {kb} + kb, mask={ok}, other=0.0)"
