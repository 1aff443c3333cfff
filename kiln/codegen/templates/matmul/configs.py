"""Config spaces of the matmul template and its default choice.

Tiled form. On Hopper (sm_90+) with fp16/bf16 operands the tiles are those that keep
wgmma fed from a 3-4 stage cp.async pipeline (Triton's own Hopper choices):
128x256x64 with 8 warps (two warpgroups, each 64x256), 128x128x64 with 4 or 8 warps,
and narrower tiles for small or skinny products. Elsewhere (mma.sync on sm_80/89,
MFMA on gfx942, fp32's exact FMA path) the Ampere-era list. Every tile comes with a
split-K cap of 1 and, when its accumulator leaves registers to spare, of `SPLIT_CAP`
(kiln.codegen.templates.split_k): split-K pays when a product has fewer tiles than SMs
(kv_proj: 512x1024 is 32 tiles of 128x128).

Measured on an H200 (benchmarks/matmul_sweep.py, Llama-3-8B prefill): 128x128x64 w8
runs 10-20% faster with 4 stages than with 3, and the split-capable build (cap 8) ~8%
faster than the plain one even when the launch does not split, so where the model
ties, those come first.

The default is the config with the least time under a wave model: the programs
launched (tiles x splits) run in waves of one per SM, each as long as its tile's
share of K divided by the tile's relative efficiency (a wider tile reuses each loaded
byte more), plus the cost of combining split parts. It needs a row count: M if static,
else its upper bound (capped at a long prompt), else a typical prefill. The list is
ordered by that model, so the tuner's "fast" mode starts from the best guesses.

GEMV form (M <= 8 rows: decode). Memory bound: what matters is enough bytes in flight,
i.e. enough programs, each streaming a [BLOCK_K, BLOCK_N] tile of 16-byte vectors per
step. A split-K cap of 16 lets N = 1024..4096 columns fill 4 programs per SM.
"""

from __future__ import annotations

import math

from kiln.codegen.build.spec import Config
from kiln.target import Target

SPLIT_CAP = 8  # most K splits of a tiled product
GEMV_SPLIT_CAP = 16
TILED_FILL = 1  # programs per SM a tiled split aims for
GEMV_FILL = 4  # ... and a GEMV's (memory bound: more loads in flight)
MIN_SPLIT_BLOCKS = 4  # K blocks a tiled split gets at least
# A GEMV split may take a single K block: its program then waits on one DRAM round trip
# instead of two (a program's K steps are not pipelined: ~0.85 us each on an H200, so a
# 2 MB router of 64 programs x 2 steps took 4.1 us); it only matters where tiles x
# K blocks leave SMs idle (small N and K), the rest split for fill first.
MIN_GEMV_BLOCKS = 1
TYPICAL_ROWS, MAX_ROWS = 2048, 4096

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
# Hopper's list holds each tile's stage / warp / shape neighbours, which the tuner's
# "fast" mode tries beside the default (kiln.codegen.autotune.candidates).
HOPPER = [
    (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (64, 256, 64, 8, 3), (128, 128, 64, 8, 4),
    (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 3), (64, 256, 64, 4, 4),
    (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 3),
    (32, 128, 64, 4, 4), (16, 128, 128, 4, 4), (16, 64, 128, 4, 3), (16, 32, 64, 2, 3),
    (16, 16, 32, 1, 1),
]
CLASSIC = [
    (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 32, 4, 4), (128, 64, 32, 4, 4),
    (64, 128, 32, 4, 4), (64, 128, 64, 4, 3), (64, 64, 64, 4, 3), (128, 32, 32, 4, 4),
    (64, 32, 32, 2, 5), (32, 64, 32, 2, 5), (32, 128, 64, 4, 3), (32, 32, 64, 2, 3),
    (16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (16, 32, 64, 2, 2), (16, 16, 32, 1, 1),
]
# (BLOCK_N, BLOCK_K, warps): a 16 KiB weight tile is 8 16-byte loads per thread of 4 warps
GEMV = [(64, 128, 4), (64, 256, 4), (32, 128, 4), (64, 128, 8), (32, 256, 4), (64, 64, 2),
        (16, 256, 2), (16, 64, 1)]


def pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def can_split(acc_elems: int, warps: int) -> bool:
    """Whether a tile may split: combining parts holds the accumulator and a part in
    registers at once, so the accumulator must take at most 64 of a thread's 255."""
    return acc_elems <= 64 * 32 * warps


def rows_hint(m, m_hi: int | None) -> int:
    """The row count the default is chosen for."""
    if isinstance(m, int):
        return m
    return min(m_hi, MAX_ROWS) if m_hi is not None else TYPICAL_ROWS


def _efficiency(bm: int, bn: int) -> float:
    """Relative per-SM throughput of a tile: flops per loaded element, against 128x256."""
    reuse = bm * bn / (bm + bn)
    return min(1.0, reuse / (128 * 256 / 384)) ** 0.6


def splits(cap: int, tiles: int, fill: int, k_blocks: int, least: int) -> int:
    """The launch's split count (kiln.codegen.templates.split_k.count, in Python)."""
    return max(1, min(cap, fill // max(1, tiles), math.ceil(k_blocks / least)))


# Combining split parts moves 4-byte partials through L2 at ~110 GB/s per SM, while a
# tile computes one element-K step in ~0.33 ps (2 flops at ~6 TFLOP/s per SM): one
# partial element costs about 110 steps.
COMBINE_STEPS = 110


def tiled_time(c: Config, m: int, n: int, k: int, batch: int, target: Target) -> float:
    """Wave-model time of a tiled config, in element-K steps of a tile (lower is better)."""
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    tiles = math.ceil(m / bm) * math.ceil(n / bn) * batch
    s = splits(c["SPLIT_K"], tiles, TILED_FILL * target.multiprocessors, math.ceil(k / bk),
               MIN_SPLIT_BLOCKS)
    k_per = math.ceil(math.ceil(k / s) / bk) * bk
    waves = math.ceil(tiles * s / target.multiprocessors)
    combine = 0.0 if s == 1 else bm * bn * (s + 1) * COMBINE_STEPS  # store one, read all
    return waves * bm * bn * k_per / _efficiency(bm, bn) + combine


def tiled_configs(m, m_hi, n, k, batch, dtype: str, target: Target) -> list[Config]:
    """Every candidate, the model's best first."""
    hopper = (target.backend in ("cuda", "interpret") and isinstance(target.arch, int)
              and target.arch >= 90 and dtype != "float32")
    out = []
    for bm, bn, bk, warps, stages in HOPPER if hopper else CLASSIC:
        if m_hi is not None and bm > max(16, pow2(m_hi)):
            continue
        if isinstance(n, int) and bn > max(16, pow2(n)):
            continue
        if isinstance(k, int) and bk > max(16, pow2(k)):
            continue
        for cap in (SPLIT_CAP, 1) if can_split(bm * bn, warps) else (1,):
            out.append(Config.make(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                   GROUP_M=8, SPLIT_K=cap))
    if not out:
        out = [Config.make(1, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=8, SPLIT_K=1)]
    rows = rows_hint(m, m_hi)
    sizes = [x if isinstance(x, int) else TYPICAL_ROWS for x in (n, k, batch)]
    return sorted(out, key=lambda c: tiled_time(c, rows, *sizes, target))


def gemv_configs(n, k) -> list[Config]:
    """Every candidate, the default (64 x 128 tiles, 4 warps, splits allowed) first."""
    out = []
    for bn, bk, warps in GEMV:
        if isinstance(n, int) and bn > max(16, pow2(n)):
            continue
        if isinstance(k, int) and bk > max(16, pow2(k)):
            continue
        for cap in (GEMV_SPLIT_CAP, 1):
            out.append(Config.make(warps, 1, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=cap))
    return out or [Config.make(1, 1, BLOCK_N=16, BLOCK_K=16, SPLIT_K=1)]


def paired(configs: list[Config], blocks: int) -> list[Config]:
    """The configs of a GEMV program that computes `blocks` column blocks of the product
    (an epilogue reading it at shifted columns, or paired siblings' products): each
    accumulator gets BLOCK_N / blocks columns, so the registers held match the
    single-block tile's. K splits as in the plain GEMV, each part holding every block's
    accumulator: SwiGLU's gate and up over N = 512 columns are 16 column blocks of 32,
    which without a split left 116 of an H200's 132 SMs idle (14 us for 4 MB)."""
    out: list[Config] = []
    for c in configs:
        params = c.as_dict()
        params["BLOCK_N"] = max(16, params["BLOCK_N"] // pow2(blocks))
        made = Config.make(c.num_warps, c.num_stages, **params)
        if made not in out:
            out.append(made)
    return out
