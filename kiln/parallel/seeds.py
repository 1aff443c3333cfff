"""Seeds: weights and buffers cut (or kept whole) before the propagation starts.

Propagation cuts an uncut weight as its first consumer asks. It cannot get two things
right alone: a buffer read before the op that decides its cut writes it (a linear
attention's recurrent and convolution state: read at the top of the layer, written
after the gated delta rule), and a small projection whose cut output would be gathered
at once (a router scoring every expert, MLA's down projections feeding a norm), which
is better whole on every rank, as vLLM keeps them.

A model says so with a `tensor_parallel_seeds()` method on any of its modules, so kiln
needs no plan per model and a model needs no import of kiln: it returns {name relative
to that module: spec}, a spec being None (whole on every rank), an axis (cut into T
equal blocks), or (axis, segment sizes) for a fused axis (each segment cut into T,
as `Sharding.segments`).
"""

from __future__ import annotations

import torch

from kiln.errors import ArgumentError, ShapeError
from kiln.parallel.sharding import REPLICATE, Sharding, divides, shard


def collect_seeds(model) -> dict[str, object]:
    """{state name: spec} from every module of `model` that defines seeds."""
    seeds: dict[str, object] = {}
    if not isinstance(model, torch.nn.Module):
        return seeds
    for prefix, module in model.named_modules():
        fn = getattr(module, "tensor_parallel_seeds", None)
        if callable(fn):
            for name, spec in fn().items():
                seeds[f"{prefix}.{name}" if prefix else name] = spec
    return seeds


def seed_sharding(name: str, size: tuple, spec, tp: int) -> Sharding:
    """The sharding a seed gives the state tensor `name` of global shape `size`."""
    if spec is None:
        return REPLICATE
    axis, segments = (spec, None) if isinstance(spec, int) else spec
    if not isinstance(axis, int) or not -len(size) <= axis < len(size):
        raise ArgumentError(f"the tensor parallel seed of {name} names axis {axis!r}; it "
                            f"has shape {list(size)}", where=name,
                            hint="a seed is None, an axis, or (axis, segment sizes)")
    axis %= len(size)
    s = shard(axis, tp, tuple(segments) if segments else None)
    if s.is_shard and not divides(size[axis], s):
        what = f"segments {list(segments)}" if segments else str(size[axis])
        raise ShapeError(f"tensor parallelism over {tp} ranks cannot cut {name} "
                         f"{list(size)} along axis {axis}: {what} not divisible by {tp} "
                         "(heads or width)", where=name,
                         hint=f"choose a tp that divides {what}")
    return s
