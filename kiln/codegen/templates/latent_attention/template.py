"""The latent attention template: one Triton kernel for a region holding kiln::latent_attention.

The op (kiln.ops.latent_attention) is MLA's absorbed attention: every head attends to
the same cached rows, the row (latent R + rotary key P) as its key and the latent as
its value. A decode step is bound by reading the cache (V3: 576 numbers per token per
layer), so the kernel reads each cache block once for a block of heads:

- a program takes one query (batch row b, query t) and BLOCK_H heads: its q tile
  [BLOCK_H, R] and rope tile [BLOCK_H, P] stay in registers; per BLOCK_N keys it
  loads the latent [BLOCK_N, R] and rotary key [BLOCK_N, P] once and uses the latent
  twice, as keys (scores = q kv^T + qr kr^T, two tl.dot in 16 bits) and as values
  (acc += p kv); online softmax in fp32 (exp2, running max and sum);
- keys stop at the query's position (input_pos[b, t]): a row never reads past its
  context, however long the cache (contiguous max_seq_len, or the table's blocks);
- paged: key s is at block_table[b, s // block_size], s % block_size, the table read
  once per key step; contiguous: at [b, s];
- when batch x queries x head blocks are too few to fill the GPU (decode at batch 1:
  V3's 128 heads are 2 to 8 programs), the keys are split across programs
  (kiln.codegen.templates.split_k, flash-decoding): each part stores its unnormalised
  output with its max and sum, and merge programs of the same launch, one per 64
  output columns, each wait for the tile's parts and merge their columns (merge.py).

Operands are read through the region's fused views by the expression emitter (the
cache's two parts are slices of one buffer, read in place). Widths come from the
shapes (padded to powers of two, masked), so tiny test models run the same kernel.
"""

from __future__ import annotations

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.latent_attention import merge
from kiln.codegen.templates.latent_attention.analysis import OP, LatentShape, analyse, pow2
from kiln.codegen.templates.latent_attention.body import LatentBody
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of, to_str
from kiln.target import Target

__all__ = ["OP", "config_space", "generate", "heuristic"]

HEAD_BLOCKS = (64, 32, 16)
KEY_BLOCKS = (64, 32, 16)
MIN_SPLIT_BLOCKS = 1  # key blocks a part gets at least, its tile merged by merge programs
# ... and a tile of fewer parts than merge.SPREAD_MIN, merged by its last part alone: that
# merge costs more than a key block (an H200 at V3's widths, batch 1, tune none: context
# 128 in 2 parts 18.1 us against 12.3 whole, context 256 in 2 parts 20.8 against 14.7 in
# 4 with merge programs and 12.3 at 128 whole), so such a split needs longer parts
SERIAL_MIN_BLOCKS = 4
SPLIT_CAP = 64  # most parts the keys are split into
MERGE_BALANCE = 1.0  # splits at most sqrt(MERGE_BALANCE * key bytes / chunk bytes): see
# split_limit
MAX_KEY_TILE = 32 * 1024  # BLOCK_N x R elements: [64, 512] compiled for sm_90 without
# spilling at 32 heads (143 registers) once the latent is held in chunks (body.CHUNKS)
MAX_SCORE_TILE = 2048  # BLOCK_H x BLOCK_N: 64 x 64 spilled 102 registers on sm_90
MAX_ACC_REGISTERS = 64  # fp32 accumulator elements per thread a config may hold
STAGES = (2,)  # the key loop is bound by its loads: one stage (nothing in flight) took
# more shared memory and registers than two at V3's widths on sm_90 (compile-only)
WARPS = (4, 8)  # 16 warps leave 128 registers a thread: spilled heavily at R = 512


def _warps(shape: LatentShape, block_h: int) -> int | None:
    """The fewest warps that hold a head block's fp32 accumulator (BLOCK_H x R) in
    MAX_ACC_REGISTERS a thread; else 8 while it takes at most twice that (64 heads at
    V3's 512: spills a little on sm_90, and halves the cache re-reads: the tuner
    decides); None beyond."""
    rp = pow2(shape.latent_dim)
    for w in WARPS:
        if block_h * rp / (w * 32) <= MAX_ACC_REGISTERS:
            return w
    return WARPS[-1] if block_h * rp / (WARPS[-1] * 32) <= 2 * MAX_ACC_REGISTERS else None


def config_space(shape: LatentShape) -> list[Config]:
    """Head blocks (with their warps), key blocks and splitting or not, most
    heads per program first: each head block reads the cache once more (from L2).

    Key tiles are at most MAX_KEY_TILE elements (BLOCK_N x R) and score tiles
    MAX_SCORE_TILE (larger ones spilled on sm_90 at V3's R = 512: the q tile is held in
    registers too). Every config
    may split: the merge never holds a part beside the accumulator (body._combine)."""
    rp = pow2(shape.latent_dim)
    heads = [h for h in HEAD_BLOCKS if h <= pow2(shape.heads)] or [16]
    keys = [n for n in KEY_BLOCKS if n * rp <= MAX_KEY_TILE] or [16]
    configs = []
    for bh in heads:
        warps = _warps(shape, bh)
        if warps is None:
            continue
        for bn in (n for n in keys if bh * n <= MAX_SCORE_TILE):
            for stages in STAGES:
                for cap in (SPLIT_CAP, 1):
                    configs.append(Config.make(warps, stages, BLOCK_H=bh, BLOCK_N=bn,
                                               KV_SPLIT=cap))
    return configs


def heuristic(shape: LatentShape, target: Target, rows_hi: int | None = None) -> Config:
    """The untuned choice: 16 heads per program on 4 warps where 32-head tiles would be
    few (batch x queries x 32-head blocks, `rows_hi` rows at most, under a quarter of
    the multiprocessors: decode at small batches), else 32 heads (16 when there are no
    more); the warps that hold the accumulator in 64 registers a thread (8 at V3's 512
    for 32 heads: compiled for sm_90 without spilling). Fewer heads a program read the
    cache more often (from L2) but spread a small decode over more programs: on an
    H200 at V3's widths, batch 1, 16 heads were 16.5 -> 13.2 us at context 128 and
    46.5 -> 32.5 us at 2048 (both with their split counts, split_limit). [64, 512] key
    tiles (on an H100, bf16: 1.3-1.6x faster than [32, 512] from batch 1 to 32), two
    stages. The interpreter runs one stage."""
    rp = pow2(shape.latent_dim)
    bh = 16 if shape.heads <= 16 else 32
    few = target.multiprocessors // 4
    if rows_hi is not None and rows_hi * -(-shape.heads // 32) < few:
        bh = 16
    bn = 64 if 64 * rp <= MAX_KEY_TILE else 32
    stages = 1 if target.backend == "interpret" else 2
    return Config.make(_warps(shape, bh) or WARPS[-1], stages, BLOCK_H=bh, BLOCK_N=bn,
                       KV_SPLIT=SPLIT_CAP)


def split_limit(shape: LatentShape, keys: str) -> str:
    """Grid expression: the most parts a tile's keys are split into. A part program reads
    keys / n cached rows; a merge program (merge.py) reads n parts of its DC columns
    (BLOCK_H x DC fp32, as large as 7 cached rows at V3's widths for 16 heads). n =
    sqrt(key bytes / chunk bytes) makes the two equal and their sum least (B1 ctx
    2048: 24 parts of 16 heads, then capped at 16 by the blocks and the fill)."""
    row = (shape.latent_dim + shape.rope_dim) * shape.dtype.itemsize
    chunk = min(merge.DC, pow2(shape.latent_dim)) * 4
    balanced = f"int(({MERGE_BALANCE} * {keys} * {row} / (BLOCK_H * {chunk})) ** 0.5)"
    return f"max(1, min({balanced}, cdiv({keys}, {MIN_SPLIT_BLOCKS} * BLOCK_N)))"


def serial_split_or_none(n: str, keys: str, rp: int) -> str:
    """Grid expression: `n` parts, or none when fewer parts than get merge programs
    (merge.spread) would each hold fewer than SERIAL_MIN_BLOCKS key blocks."""
    return (f"(({n}) if ({n}) >= {merge.spread(rp)} or cdiv({keys}, BLOCK_N) >= "
            f"{SERIAL_MIN_BLOCKS} * ({n}) else 1)")


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The latent attention kernel of `region`; raises CodegenUnsupported saying why not."""
    shape = analyse(region, plan)
    p = SymbolicArgs(plan.symbols)
    em = Emitter(region, plan, p, target)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    lines = LatentBody(em, p, shape).lines()
    name = kernel_name("latent_attention", region)
    tunables = ["BLOCK_H", "BLOCK_N", "KV_SPLIT"]
    params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    head_blocks = f"cdiv({shape.heads}, BLOCK_H)"
    queries = p.grid(shape.batch * shape.tq)
    tiles = f"{head_blocks} * {queries}"
    keys = p.grid(shape.keys)
    n_split = serial_split_or_none(split.count("KV_SPLIT", tiles, target.multiprocessors,
                                               split_limit(shape, keys)),
                                   keys, pow2(shape.latent_dim))
    configs = config_space(shape)
    default = heuristic(shape, target, bounds_of(shape.batch * shape.tq, plan.symbols).hi)
    if default not in configs:
        configs.insert(0, default)
    rp = pow2(shape.latent_dim)
    meta = {"latent_dim": shape.latent_dim, "rope_dim": shape.rope_dim,
            "latent_dim_pad": rp, "rope_dim_pad": pow2(shape.rope_dim),
            "heads": shape.heads, "paged": shape.paged,
            "dtype": str(shape.dtype).replace("torch.", ""),
            # timed at the last position the cache holds: every key read, as decode at
            # a long context (zeros would time one key)
            "timing_fill": {shape.input_pos: to_str(shape.keys - 1)}}
    return KernelSpec(name, source, p.args(), tunables,
                      (head_blocks, queries, merge.grid_axis(n_split, rp)),
                      configs, default, "latent_attention", meta,
                      64 if p.needs_int64 else 32,
                      scratch=merge.scratch(tiles, n_split, f"BLOCK_H * {rp + 2}"))
