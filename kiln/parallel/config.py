"""`parallel=` of kiln.compile: how many devices split the model, and which one this is.

kiln is SPMD, as torchrun and vLLM are: every rank compiles the same model and keeps
its own part. World rank r = pp_rank * tp + tp_rank, so a tensor-parallel group is
consecutive ranks (the fast links of one host) and a pipeline group is every tp-th.
The rank is known when the plan is made: it decides the weight slices and the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import ArgumentError

_KEYS = {"tp", "pp", "rank", "pp_split"}


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    rank: int = 0
    # layers (numbered module groups) per pipeline stage; None balances weight bytes
    pp_split: tuple[int, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp + tp_rank


def parse_parallel(spec, rank: int | None = None) -> ParallelConfig:
    """`parallel=` as given ({"tp": 2, "pp": 2}, or None) checked and made a config.

    `rank` is this process's world rank when `spec` does not say (torchrun's RANK).
    """
    if spec is None:
        return ParallelConfig()
    if isinstance(spec, ParallelConfig):
        return spec
    if not isinstance(spec, dict):
        raise ArgumentError(f"parallel= must be a dict like {{'tp': 2, 'pp': 1}}, got {spec!r}")
    unknown = set(spec) - _KEYS
    if unknown:
        raise ArgumentError(f"parallel= has unknown keys {sorted(unknown)}",
                            hint=f"use {sorted(_KEYS)}")
    sizes = {}
    for key in ("tp", "pp"):
        value = spec.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArgumentError(f"parallel[{key!r}] must be a positive int, got {value!r}")
        sizes[key] = value
    world = sizes["tp"] * sizes["pp"]
    r = spec.get("rank", 0 if rank is None else rank)
    if not isinstance(r, int) or not 0 <= r < world:
        raise ArgumentError(f"rank {r!r} is outside the {world} ranks of tp={sizes['tp']} x "
                            f"pp={sizes['pp']}",
                            hint="launch exactly tp * pp processes (torchrun --nproc-per-node "
                            f"{world})")
    split = spec.get("pp_split")
    if split is not None:
        split = tuple(split)
        if len(split) != sizes["pp"] or any(not isinstance(n, int) or n < 1 for n in split):
            raise ArgumentError(f"parallel['pp_split'] {list(split)} must give {sizes['pp']} "
                                "positive layer counts, one per pipeline stage")
    return ParallelConfig(sizes["tp"], sizes["pp"], r, split)
