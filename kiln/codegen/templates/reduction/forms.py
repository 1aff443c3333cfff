"""Which form a row kernel takes, and its candidate configs.

A row kernel (reduction.py) reduces rows of `rnumel` elements, `outer` of them. Forms:

- persistent: the row is one RBLOCK tile in registers, read once. Rows up to what one
  block can hold: 32 values of 4 bytes per thread at the target's largest block (32768
  on sm_80/sm_90/gfx942: half the 64 registers each of 1024 threads has, leaving room
  for temporaries and indices without spilling). Softmax over a 32000-word vocabulary
  takes one read and one write instead of two reads and a write.
- looped: longer (or unbounded) rows are swept in RBLOCK chunks, loads running
  RSTAGES - 1 chunks ahead (tl.range's pipelining: cp.async through shared memory),
  since one program per long row leaves few programs to hide latency with.
- split (a looped form): when the rows are few, a second grid axis splits each row into
  chunks; each program reduces its chunk and adds its partial result atomically into
  the output, which the launch zeroes first (KernelSpec.zero_outputs). Only for fp32
  sums and means (the result is eager's within fp32 rounding): column sums of a
  [8192, 8192] matrix would otherwise run 128 programs on a 132-SM GPU.

Strided rows (the reduced axes are not innermost) are read as [XBLOCK, RBLOCK] tiles
whose XBLOCK side is contiguous in memory, so loads coalesce and vectorise across rows.
"""

from __future__ import annotations

import triton

from kiln.codegen.build.spec import Config
from kiln.target import Target

PERSISTENT_MAX = 16384  # rows always held whole when static (any dtype)
PERSISTENT_MAX_DYNAMIC = 1024  # ... when the size is dynamic (a padded tile costs work)
# A strided row is read coalesced across XBLOCK rows, so a whole row fits a tile only
# when it is short.
PERSISTENT_MAX_STRIDED = 64
HELD_BYTES_PER_THREAD = 128  # of a row held in registers, at the largest block
# Shared memory a default config may stage for pipelined loads: fits every target
# (gfx942 has 64 KiB), so the heuristic config never needs a fallback.
DEFAULT_STAGED = 48 * 1024

# The split form: aim for about this many programs (a few per SM on today's GPUs: 132 on
# H100/H200, 108 on A100, 304 on MI300X), each reducing at least SPLIT_MIN_CHUNKS chunks
# so the atomic adds stay few next to the loads.
SPLIT_PROGRAMS = 1024
SPLIT_MIN_CHUNKS = 4
# ... and only when the outer count can be small: with this many rows (innermost) or
# columns (strided) the first grid axis alone fills the GPU.
SPLIT_OUTER_MAX = 32768


def persistent_limit(target: Target, static: bool, innermost: bool, elem_bytes: int) -> int:
    """The longest row (elements) a persistent kernel holds; `elem_bytes`: the widest
    value computed per element (4 for fp16/bf16/fp32 math, 8 for fp64 or int64)."""
    if not innermost:
        return PERSISTENT_MAX_STRIDED
    if not static:
        return PERSISTENT_MAX_DYNAMIC
    held = target.max_threads_per_block * HELD_BYTES_PER_THREAD // max(4, elem_bytes)
    return max(PERSISTENT_MAX, _floor_pow2(held))


def split_grid(outer_code: str, rnumel_code: str) -> str:
    """Grid axis 1 of the split form: programs per row, from the launch's sizes."""
    return (f"max(1, min(cdiv({rnumel_code}, RBLOCK * {SPLIT_MIN_CHUNKS}), "
            f"cdiv({SPLIT_PROGRAMS}, cdiv({outer_code}, XBLOCK))))")


def reduction_configs(form: str, rbound: int | None, outer_bound: int | None,
                      innermost: bool, static: bool, target: Target, load_bytes: int = 4
                      ) -> tuple[list[Config], Config]:
    """Candidates (XBLOCK, RBLOCK, num_warps; RSTAGES for loops) and the heuristic
    default, best guesses first: the tuner's fast mode tries the default and the first
    of its one-knob neighbours.

    form: "persistent" | "looped" | "split". RSTAGES pipelines a loop's loads
    (tl.range(num_stages=...): RSTAGES - 1 chunks in flight ahead, through shared
    memory); `load_bytes`, the bytes one chunk element loads over all inputs, bounds it.
    """
    max_warps = max(1, target.max_threads_per_block // target.warp_size)
    xcap = triton.next_power_of_2(outer_bound) if outer_bound else 1024
    if form == "persistent":
        configs, default = _persistent(rbound, xcap, innermost, max_warps, target.warp_size)
        return [default] + [c for c in dict.fromkeys(configs) if c != default], default
    rcap = triton.next_power_of_2(rbound) if rbound else 1 << 30
    # A loop over few programs needs loads in flight; the split form has many programs.
    # Strided chunks stage one ahead (three stages of a column gather spilled on sm_90).
    want = 1 if form == "split" else 3 if innermost else 2

    def staged(x, r, s):  # shared memory holding the loads in flight
        return (s - 1) * x * r * load_bytes if s > 1 else 0

    if innermost:
        near, rest, (xb, rb, w) = _looped_rows(rcap, static, max_warps)
    else:
        near, rest, (xb, rb, w) = _looped_strided(rcap, xcap, max_warps)
    st = next(s for s in (want, 2, 1) if s <= want and staged(xb, rb, s) <= DEFAULT_STAGED)
    default = Config.make(w, 1, XBLOCK=xb, RBLOCK=rb, RSTAGES=st)
    near = [(x, r, ws, st) for x, r, ws in near] + [(xb, rb, w, s) for s in (st + 1, st - 1)]
    rest = [(x, r, ws, s) for x, r, ws in rest for s in (1, 2, 3)]
    configs = []
    for x, r, ws, s in near + rest:
        if (1 <= x <= xcap and 1 <= r <= rcap and 1 <= ws <= max_warps and 1 <= s <= 4
                and ws * target.warp_size <= max(x * r, 32) * (1 if innermost else 2)
                and staged(x, r, s) <= target.shared_mem_per_block // 2):
            configs.append(Config.make(ws, 1, XBLOCK=x, RBLOCK=r, RSTAGES=s))
    return [default] + [c for c in dict.fromkeys(configs) if c != default], default


def _persistent(rbound, xcap, innermost, max_warps, warp_size):
    """RBLOCK covers the row; XBLOCK rows per program fill a tile of ~2-4K elements (more
    rows when the row is strided, so loads coalesce across rows). Warps: one per 512
    elements up to 16, more when a thread would hold over 32 values. Candidates hold
    at most 64 values a thread (more spill)."""
    rb = triton.next_power_of_2(max(rbound, 1))
    target = 2048 if innermost else 4096
    xb = max(1, min(xcap, target // rb, 128))
    w = max(1, min(16, (xb * rb) // 512))
    while xb * rb > 32 * w * warp_size and w < max_warps:
        w *= 2
    default = Config.make(w, 1, XBLOCK=xb, RBLOCK=rb)

    def ok(x, warps):
        if not (1 <= x <= min(xcap, 128) and x * rb <= 32768 and 1 <= warps <= max_warps):
            return False
        per_thread = x * rb / (warps * warp_size)
        return per_thread <= 64 and (warps == 1 or per_thread >= 0.5)

    near = [(xb, w // 2), (xb, w * 2), (xb * 2, w), (xb // 2, w), (xb * 2, w * 2),
            (xb // 2, w // 2)]
    rest = [(x, warps) for x in (1, 2, 4, 8, 16, 32, 64, 128) for warps in (1, 2, 4, 8, 16, 32)]
    configs = [Config.make(warps, 1, XBLOCK=x, RBLOCK=rb) for x, warps in near + rest
               if ok(x, warps)]
    return configs, default


def _looped_rows(rcap, static, max_warps):
    """Innermost rows swept in chunks, one row per program: (neighbours, others, the
    default's (XBLOCK, RBLOCK, warps)). Long static rows (a 128K vocabulary) take 4K
    chunks over 16 warps: fewer, larger programs keep fewer rows in flight, so a later
    sweep finds more of its row still in L2."""
    long_rows = static and rcap >= 65536
    rb = min(4096 if long_rows else 2048, rcap)
    w = min(16 if long_rows else 8, max_warps, max(1, rb // 128))
    near = [(1, rb * 2, w), (1, rb, w * 2), (1, rb // 2, w), (1, rb, w // 2), (2, rb, w),
            (1, rb * 4, w)]
    rest = [(1, r, ws) for r in (1024, 2048, 4096, 8192, 16384) for ws in (4, 8, 16, 32)]
    rest += [(2, 1024, 4), (2, 2048, 8), (4, 512, 4), (8, 256, 4)]
    rest += [(1, r, ws) for r in (64, 128, 256, 512) for ws in (1, 2, 4)]
    return near, rest, (1, rb, w)


def _looped_strided(rcap, xcap, max_warps):
    """Strided rows: XBLOCK contiguous columns by RBLOCK rows per chunk, 64 x 64 over 8
    warps by default (16 values a thread, four 16-byte loads of fp32)."""
    xb = min(64, xcap)
    rb = min(64, rcap)
    w = 8 if xb * rb >= 4096 else max(1, min(4, xb * rb // 256))
    near = [(xb * 2, rb, w), (xb // 2, rb, w), (xb, rb * 2, w), (xb, rb // 2, w),
            (xb, rb, w * 2), (xb, rb, w // 2)]
    rest = [(x, r, ws) for x in (64, 32, 128, 16, 8, 4, 2, 1)
            for r in (64, 32, 128, 16, 256, 8) for ws in (8, 4, 16, 2)
            if 128 <= x * r <= 16384]
    return near, rest, (xb, rb, w)


def _floor_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)
