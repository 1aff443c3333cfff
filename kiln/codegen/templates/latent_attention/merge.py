"""The latent attention's split merge, spread over programs of its own (body.py's lines).

With the keys split, each part program stores its unnormalised [BLOCK_H, R] accumulator
with its running max and sum. The last part to arrive used to merge them all alone: at
V3's R = 512 that was 8 column chunks, each a chain of part loads, one SM reading every
part (an H200, batch 1, context 2048: 32.5 us for ~1 us of cache bytes). Here the
launch holds more programs a tile, one per DC-column chunk (never more than the parts:
then each takes several chunks): each waits until every part of its tile has arrived,
then merges its chunks' columns and stores them, the chunks in parallel. A tile of few
parts (SPREAD_MIN) keeps the last-arrival merge: there the merge is short and spinning
programs beside the parts cost more than it.

Programs take roles by ticket (an atomic counter read as a program starts, as the
gated delta kernel's launch.py does): the first tiles x n_split tickets compute parts,
the rest merge. A merge program waits only on parts, which took earlier tickets and so
are running: no deadlock whatever order the GPU starts programs in, and the
interpreter (one program after another, in order) never waits. Counters: one arrival
count a tile, then the ticket count; each is zero again when the launch ends (the last
of a tile's merges zeroes its count, the last ticket's program the ticket count).
"""

from __future__ import annotations

from kiln.codegen.build.spec import Scratch
from kiln.codegen.templates import split_k as split

DC = 64  # output columns a merge program takes
# Parts from which a tile gets merge programs; below, its last part merges alone. An
# H200 at V3's widths: batch 1, context 2048 (16 parts) 39.1 -> 22.5 us with merge
# programs; batch 8 (2 parts) 64.0 -> 72.8 us (their spinning shares the SMs).
SPREAD_MIN = 4


def chunks(rp: int) -> int:
    """DC-wide column chunks of the (padded) latent."""
    return rp // min(DC, rp)


def scratch(tiles: str, splits: str, numel: str) -> list[Scratch]:
    """split_k's parts, and its counters with the ticket count after the tiles'."""
    parts, counts = split.scratch(tiles, splits, numel)
    return [parts, Scratch(counts.name, counts.dtype,
                           f"({tiles}) + 1 if ({splits}) > 1 else 1", zeroed=True)]


def spread(rp: int) -> int:
    """The fewest parts that get merge programs of their own (at most the chunks)."""
    return min(SPREAD_MIN, chunks(rp))


def grid_axis(splits: str, rp: int) -> str:
    """Grid axis 2: the parts, and from spread() parts the merge programs after them, one
    per column chunk but never more than the parts."""
    c, t = chunks(rp), spread(rp)
    return f"({splits}) + (min({c}, ({splits})) if ({splits}) >= max(2, {t}) else 0)"


def roles(wide: str, rp: int) -> list[str]:
    """Lines at the top of the kernel: pid_h, pid_z, pid_s, n_split, n_merge (merge
    programs a tile) and `merging` (a merge program; pid_s is then its first column
    chunk), from the program ids or, with merge programs, from a ticket."""
    c, t = chunks(rp), spread(rp)
    return [
        "pid_h = tl.program_id(0)",
        f"pid_z = tl.program_id(1){wide}",
        "pid_s = tl.program_id(2)",
        "n_split = tl.num_programs(2)",
        "n_merge = n_split * 0",
        "merging = pid_s < 0",
        "ticket = pid_s * 0",
        "if KV_SPLIT > 1:",
        # the axis is parts + min(chunks, parts) from spread() parts (grid_axis), at
        # least twice spread(); below it, the parts alone
        f"    if n_split >= max(2, {2 * t}):",
        f"        n_split = tl.where(n_split > {2 * c}, n_split - {c}, n_split // 2)",
        f"        n_merge = tl.minimum(n_split, {c})",
        "        n_tiles = tl.num_programs(0) * tl.num_programs(1)",
        f"        ticket = tl.atomic_add({split.COUNTS} + n_tiles, 1)",
        "        n_parts = n_tiles * n_split",
        "        merging = ticket >= n_parts",
        "        k = tl.where(merging, ticket - n_parts, ticket)",
        "        per_tile = tl.where(merging, n_merge, n_split)",
        "        pid_s = k % per_tile",
        "        pid_h = (k // per_tile) % tl.num_programs(0)",
        f"        pid_z = ((k // per_tile) // tl.num_programs(0)){wide}",
    ]


def combine(store: list[str], merge: list[str]) -> list[str]:
    """Lines after the key loop: a part program stores its part (`store`) and counts its
    arrival; the merger (a merge program once every part of its tile has arrived, or
    without merge programs the last part to arrive) runs `merge` over its chunks
    (chunk0, chunk0 + chunk_step, ...) and counts itself out. Then `h_ok` gates the
    plain store to unsplit launches."""
    count = f"{split.COUNTS} + tile_id"
    return [
        "if KV_SPLIT > 1:",
        "    if n_split > 1:",
        "        n_tiles = tl.num_programs(0) * tl.num_programs(1)",
        "        tile_id = pid_z * tl.num_programs(0) + pid_h",
        "        merger = merging",
        "        if merging:",
        f"            while tl.load({count}, volatile=True) < n_split:",
        "                pass",
        f'            tl.atomic_add({count}, 0, sem="acquire")  # the parts\' stores are seen',
        "        else:",
        *["            " + x for x in store],
        "            tl.debug_barrier()  # this CTA's part is stored before it is counted",
        f'            arrived = tl.atomic_add({count}, 1, sem="acq_rel")',
        "            merger = (n_merge == 0) & (arrived == n_split - 1)",
        "        if merger:",
        "            chunk0 = tl.where(merging, pid_s, 0)",
        "            chunk_step = tl.maximum(n_merge, 1)",
        *["            " + x for x in merge],
        f'            out_n = tl.atomic_add({count}, 1, sem="relaxed")',
        "            if out_n == n_split + chunk_step - 1:  # the tile's last: zero again",
        f"                tl.store({count}, 0)",
        "        if n_merge > 0:",
        "            if ticket == n_tiles * (n_split + n_merge) - 1:  # every ticket taken",
        f"                tl.store({split.COUNTS} + n_tiles, 0)",
        "h_ok = h_ok & (n_split == 1)  # a split's output is stored by its merger",
    ]
