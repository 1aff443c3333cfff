"""Memory planning: intermediates share buffers when their lifetimes do not overlap.

Sizes can be symbolic (even unbounded), so the plan assigns values to *slots*, not
byte offsets: two values share a slot when no region needs both at once. At call
time each slot's size is the largest of its values at the actual sizes, slots are
laid out in one arena, and every value is a view into it. The assignment is made
once, by size at the example (or largest) shapes, largest first (greedy by size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.ir.plan import DispatchPlan, Role
from kiln.ir.symbolic import Dim, evaluate, numel

ALIGN = 256  # bytes; enough for any dtype and for vectorised GPU loads


@dataclass
class Slot:
    values: list[str] = field(default_factory=list)
    intervals: list[tuple[int, int]] = field(default_factory=list)

    def free_during(self, start: int, end: int) -> bool:
        return all(end < s or start > e for s, e in self.intervals)


@dataclass
class MemoryPlan:
    slots: list[Slot]
    slot_of: dict[str, int]  # value -> slot index
    nbytes: dict[str, Dim]  # value -> size in bytes (symbolic)

    def slot_bytes(self, env: dict[str, int]) -> list[int]:
        return [max((evaluate(self.nbytes[v], env) for v in s.values), default=0)
                for s in self.slots]

    def layout(self, env: dict[str, int]) -> tuple[int, dict[int, int]]:
        """Arena size and each slot's byte offset at these sizes."""
        offsets, total = {}, 0
        for i, size in enumerate(self.slot_bytes(env)):
            offsets[i] = total
            total += -(-size // ALIGN) * ALIGN
        return total, offsets

    def peak_bytes(self, env: dict[str, int]) -> int:
        return self.layout(env)[0]

    def total_bytes(self, env: dict[str, int]) -> int:
        """What the intermediates would take with no reuse at all."""
        return sum(evaluate(b, env) for b in self.nbytes.values())

    def to_json(self) -> dict:
        return {"slots": [s.values for s in self.slots]}


def lifetimes(plan: DispatchPlan) -> dict[str, tuple[int, int]]:
    """[first, last] region index during which each memory-planned value is alive."""
    planned = {n for n, v in plan.values.items() if v.role == Role.TEMP}
    inplace = {o for r in plan.regions for o in r.inplace}
    live: dict[str, tuple[int, int]] = {}
    for i, r in enumerate(plan.regions):
        for o in r.outputs:
            if o in planned and o not in inplace:
                live[o] = (i, i)
    for i, r in enumerate(plan.regions):
        for v in r.inputs:
            if v in live:
                live[v] = (live[v][0], max(live[v][1], i))
    # Values copied back into state are read after the last region.
    end = len(plan.regions)
    for v in plan.state_writes.values():
        if v in live:
            live[v] = (live[v][0], end)
    return live


def plan_memory(plan: DispatchPlan, hint_env: dict[str, int]) -> MemoryPlan:
    live = lifetimes(plan)
    nbytes = {v: numel(plan.values[v].shape) * plan.values[v].itemsize for v in live}
    order = sorted(live, key=lambda v: (-evaluate(nbytes[v], hint_env), live[v][0]))
    slots: list[Slot] = []
    slot_of: dict[str, int] = {}
    for v in order:
        start, end = live[v]
        size = evaluate(nbytes[v], hint_env)
        best = None
        for i, s in enumerate(slots):
            if not s.free_during(start, end):
                continue
            cap = max(evaluate(nbytes[m], hint_env) for m in s.values)
            # Best fit: the smallest slot that holds v, else the largest (it grows least).
            score = (0, cap) if cap >= size else (1, -cap)
            if best is None or score < best[0]:
                best = (score, i)
        if best is None:
            slots.append(Slot())
            idx = len(slots) - 1
        else:
            idx = best[1]
        slots[idx].values.append(v)
        slots[idx].intervals.append((start, end))
        slot_of[v] = idx
    return MemoryPlan(slots, slot_of, nbytes)


class Arena:
    """One device allocation per call size, reused while sizes repeat."""

    def __init__(self, mem: MemoryPlan, plan: DispatchPlan, device):
        self.mem = mem
        self.plan = plan
        self.device = torch.device(device)
        self._storage: torch.Tensor | None = None
        self._cache_key = None
        self._views: dict[str, torch.Tensor] = {}

    @property
    def storage(self) -> torch.Tensor | None:
        """The allocation the views point into; a new one when a call needs more."""
        return self._storage

    def views(self, env: dict[str, int]) -> dict[str, torch.Tensor]:
        key = tuple(sorted(env.items()))
        if key == self._cache_key:
            return self._views
        total, offsets = self.mem.layout(env)
        if self._storage is None or self._storage.numel() < total:
            self._storage = torch.empty(total, dtype=torch.uint8, device=self.device)
        views, typed = {}, {}
        for v, slot in self.mem.slot_of.items():
            tv = self.plan.values[v]
            shape = [evaluate(d, env) for d in tv.shape]
            base = typed.get(tv.dtype)
            if base is None:  # the storage (a multiple of ALIGN bytes) as this dtype
                base = typed[tv.dtype] = self._storage.view(tv.dtype)
            # one as_strided per value: a third of a slice and two views' host time
            views[v] = base.as_strided(shape, _dense_strides(shape),
                                       offsets[slot] // tv.dtype.itemsize)
        self._cache_key, self._views = key, views
        return views


def _dense_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)  # as torch lays out tensors with an empty dim
    return strides[::-1]
