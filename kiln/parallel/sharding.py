"""How a value is divided among the T ranks of a tensor-parallel group.

Three kinds, as in GSPMD: replicated (every rank holds all of it), sharded along one
axis, and partial (every rank holds a summand: a matmul whose contraction axis was
split, finished by an all-reduce). A sharded axis is cut into `parts` equal blocks and
rank r holds block r * parts // T: with parts == T every rank holds its own block; with
fewer parts neighbouring ranks hold the same block (the KV heads of a GQA model with
fewer KV heads than ranks are replicated this way, as vLLM does).

`segments` describes a fused projection (one weight holding q, k and v, or gate and up,
split apart in forward): the axis is a run of segments, each cut into `parts` blocks,
and a rank's local tensor is its block of every segment, in order. Slicing the fused
output then gives each rank its block of q, of k and of v.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sharding:
    kind: str  # "replicate" | "shard" | "partial"
    axis: int | None = None
    parts: int = 1
    segments: tuple[int, ...] | None = None

    @property
    def is_shard(self) -> bool:
        return self.kind == "shard"

    def __str__(self) -> str:
        if self.kind != "shard":
            return self.kind
        segs = f", segments {list(self.segments)}" if self.segments else ""
        return f"shard(axis {self.axis}, {self.parts} parts{segs})"


REPLICATE = Sharding("replicate")
PARTIAL = Sharding("partial")


def shard(axis: int, parts: int, segments: tuple[int, ...] | None = None) -> Sharding:
    return REPLICATE if parts == 1 else Sharding("shard", axis, parts, segments)


def block(parts: int, tp: int, rank: int) -> int:
    """Which block of an axis cut in `parts` the rank `rank` of `tp` holds."""
    return rank * parts // tp


def segment_bounds(size: int, s: Sharding) -> list[tuple[int, int]]:
    """(start, length) of each segment of the sharded axis (one segment if not fused)."""
    sizes = s.segments or (size,)
    out, start = [], 0
    for n in sizes:
        out.append((start, n))
        start += n
    return out


def local_ranges(size: int, s: Sharding, tp: int, rank: int) -> list[tuple[int, int]]:
    """The (start, end) ranges of the global axis that rank `rank` holds, in local order."""
    b = block(s.parts, tp, rank)
    ranges = []
    for start, n in segment_bounds(size, s):
        step = n // s.parts
        ranges.append((start + b * step, start + (b + 1) * step))
    return ranges


def divides(size, s: Sharding) -> bool:
    """Can the axis of this size be cut as `s` says (static, every segment divisible)?"""
    if not isinstance(size, int):
        return False
    sizes = s.segments or (size,)
    return sum(sizes) == size and all(n % s.parts == 0 for n in sizes)


def local_tensor(t: torch.Tensor, s: Sharding, tp: int, rank: int) -> torch.Tensor:
    """This rank's part of a weight or buffer (contiguous: kernels read row-major)."""
    if not s.is_shard:
        return t
    pieces = [t.narrow(s.axis, a, b - a) for a, b in local_ranges(t.shape[s.axis], s, tp, rank)]
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, s.axis)).contiguous()
