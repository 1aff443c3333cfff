"""Split reductions: an output with too few tiles to fill the GPU splits its reduction
(a matmul's K, attention's keys) across programs; the last program to finish a tile
combines the parts and alone runs the epilogue.

A decode GEMV over N = 4096 columns has 64 tiles of 64 columns, and decode attention
over 8 KV heads has 8 tiles: a few SMs of 132 stream all the bytes. Here grid axis 2
holds `n_split` programs per tile, each reducing a contiguous range of whole blocks.
Each stores its partial result in a scratch buffer, waits for its CTA's stores
(a barrier), and counts its arrival on the tile's counter with an acq_rel atomic, so
its stores are visible to whoever sees the count. The program that arrives last reads
every part in split order (the result does not depend on arrival order), zeroes the
counter again for the next launch, and stores the tile; the others store nothing. One
launch, no second kernel and no zero-fill pass (counters are zeroed once, when the
launcher allocates them: kiln.codegen.build.spec.Scratch).

How many splits is decided at launch by the grid expression (`count`), from the sizes:
enough programs to fill the chip, at most the config's cap (a tunable, so the tuner
can choose between splitting or not) and never fewer than a few blocks per split. A
cap of 1 compiles none of this (a constexpr branch): the kernel is the plain one.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Scratch

PARTS = "ws_ptr"  # fp32 partial results: [tiles, n_split, numel]
COUNTS = "lock_ptr"  # int32 arrival counters: [tiles]
UNROLL = 4  # parts the last program loads at once when it combines small tiles
UNROLL_ELEMENTS = 2048  # the largest tile (elements) combined UNROLL parts at a time
# A GEMV's tile (a few rows of BLOCK_N columns) has its every part (16 at most:
# matmul configs' GEMV_SPLIT_CAP) loaded at once: one L2 round trip, not four.
UNROLL_SMALL, SMALL_ELEMENTS = 16, 256


def count(cap: str, tiles: str, fill: int | str, most: str) -> str:
    """Grid expression: the splits per tile, so that tiles * splits reaches `fill`
    programs (a number or an expression), at most the tunable `cap` and at most `most`
    (an expression)."""
    return f"max(1, min({cap}, ({fill}) // max(1, {tiles}), {most}))"


def scratch(tiles: str, splits: str, numel: str) -> list[Scratch]:
    """The two buffers: parts of `numel` fp32 per (tile, split), a counter per tile
    (a single element when the launch does not split)."""
    return [Scratch(PARTS, torch.float32, f"({tiles}) * ({splits}) * ({numel}) "
                    f"if ({splits}) > 1 else 1"),
            Scratch(COUNTS, torch.int32, f"({tiles}) if ({splits}) > 1 else 1", zeroed=True)]


def program_range(total: str, block: str, start: str = "0",
                  splits: str = "n_split") -> list[str]:
    """Lines setting `lo`, `hi`: this split's part of [start, total) among `splits`, in
    whole blocks (`start` an expression, block-aligned; a split past the range gets
    none of it)."""
    if start == "0":
        return [
            f"per_split = tl.cdiv(tl.cdiv({total}, {splits}), {block}) * {block}",
            "lo = pid_s * per_split",
            f"hi = tl.minimum({total}, lo + per_split)",
        ]
    return [
        f"per_split = tl.cdiv(tl.cdiv({total} - {start}, {splits}), {block}) * {block}",
        f"lo = {start} + pid_s * per_split",
        f"hi = tl.minimum({total}, lo + per_split)",
    ]


def part(numel: str, split: str = "pid_s") -> str:
    """The address of part `split` of this program's tile (add the element offsets)."""
    return f"{PARTS} + (tile_id * n_split + {split}) * {numel}"


def arrive(cap: str, tile: str, store: list[str], combine: list[str],
           gate: list[str], live: str = "n_split") -> list[str]:
    """Lines after the reduction loop: with splits, store this part, count the arrival,
    and (the last program only) combine every part; then `gate` (the template's lines
    that mask its store with `last`). `store` / `combine` are the template's lines.
    `live`: how many of the tile's programs arrive (the others left early), n_split
    unless the template narrowed it."""
    inner = [f"        tile_id = {tile}", *["    " * 2 + x for x in store]] + [
        "        tl.debug_barrier()  # this CTA's part is stored before it is counted",
        f'        arrived = tl.atomic_add({COUNTS} + tile_id, 1, sem="acq_rel")',
        f"        last = arrived == {live} - 1",
        "        if last:",
        *["    " * 3 + x for x in combine],
        f"            tl.store({COUNTS} + tile_id, 0)  # zero again for the next launch",
    ]
    return [f"if {cap} > 1:", "    last = pid_s == 0", f"    if {live} > 1:", *inner,
            *["    " + x for x in gate]]


def merge_loop(elements: str, body: list[str], count: str = "n_split") -> list[str]:
    """Lines running `body` for each part s in [0, count), in order. A small tile's
    parts are loaded UNROLL at a time (a GEMV's UNROLL_SMALL), so that their loads are
    in flight together: one part after another, each an L2 round trip, merging 16
    parts of a decode step took longer than computing them. `body` masks its loads
    with `s < count`. A big tile (`elements`, a constexpr expression) takes one part a
    step: UNROLL of its parts would not fit the registers."""
    step = ["    " * 2 + x for x in body]

    def unrolled(n: int) -> list[str]:
        # not s0: size symbols are kernel parameters named s0, s1, ...
        return [f"    for part_first in range(0, {count}, {n}):",
                f"        for j in tl.static_range({n}):",
                "            s = part_first + j", *["    " + x for x in step]]

    return [f"if {elements} <= {SMALL_ELEMENTS}:", *unrolled(UNROLL_SMALL),
            f"elif {elements} <= {UNROLL_ELEMENTS}:", *unrolled(UNROLL),
            "else:", f"    for s in range(0, {count}):", *step]


def load_part(address: str, mask: str, other: str = "0.0") -> str:
    """A part's elements under `mask` (padding rows and columns are never read)."""
    # .cg reads L2, where the other programs' stores are, never a stale L1 line
    return f'tl.load({address}, mask={mask}, other={other}, cache_modifier=".cg")'
