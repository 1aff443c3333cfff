"""This rank's part of a model's weight or buffer, made once per model tensor.

Modules compiled from one model (an LLM's prefill and decode modules) must share the
parts: one copy of the weights in memory, and one KV cache that both read and write.
"""

from __future__ import annotations

import weakref

import torch

from kiln.parallel.sharding import Sharding, local_tensor

_parts: dict[int, tuple[weakref.ref, dict]] = {}  # id(tensor) -> (its weakref, parts)


def rank_part(t: torch.Tensor, s: Sharding, tp: int, rank: int, private: bool) -> torch.Tensor:
    """This rank's part of `t`, the same tensor for every module compiled from `t`;
    `private` (a buffer the plan writes) never shares memory with the model's own."""
    key = id(t)
    entry = _parts.get(key)
    if entry is None or entry[0]() is not t:
        entry = (weakref.ref(t, lambda _: _parts.pop(key, None)), {})
        _parts[key] = entry
    per = entry[1]
    part_key = (s, tp, rank)
    if part_key not in per:
        part = local_tensor(t, s, tp, rank)
        shared = t.device.type != "meta" and (
            part.untyped_storage().data_ptr() == t.untyped_storage().data_ptr())
        per[part_key] = part.clone() if private and shared else part
    return per[part_key]
