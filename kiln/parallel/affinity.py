"""Affinity: which devices need each value, and what that costs (DESIGN.md failure 2).

Given where each op runs (a placement: its pipeline stage's device, or None for an op
that reads nothing placed, such as position ids or a RoPE lookup, computed wherever it
is needed), every value gets the set of devices that read it: the least fixed point of
need(v) = union over v's users u of {device(u)}, or need(u) for an unplaced u, over the
finite powerset lattice of devices (lattice.py), so it converges with no cap.

What follows from the sets: a weight or constant needed on several devices is cloned
(each holds its own copy, loaded once, never sent per call), even when the user pinned
it to one of them (the pin names its home); an activation read off the device that
computes it is transferred. Two names of one tensor (tied weights) pinned to different
devices contradict each other: an AffinityError naming them, their source and devices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from kiln.errors import AffinityError, VerifierError
from kiln.ir.graph import KilnGraph, where
from kiln.parallel.lattice import solve

_WEIGHTS = ("param", "buffer", "constant")


@dataclass
class Affinity:
    need: dict[str, frozenset[int]]  # value (node name) -> devices that read it
    clones: dict[str, frozenset[int]] = field(default_factory=dict)  # state name -> copies
    transfers: dict[str, tuple[int, frozenset[int]]] = field(default_factory=dict)
    visits: int = 0  # transfer-function evaluations the fixed point took


def _pinned_weights(kg: KilnGraph, pins: dict[str, int]) -> dict[fx.Node, int]:
    """Placeholder -> the device its state tensor is pinned to; tied names must agree."""
    holders = {n.name: n for n in kg.graph.nodes if n.op == "placeholder"}
    node_of = {spec.target: holders[spec.name] for spec in kg.inputs if spec.kind in _WEIGHTS}
    by_tensor: dict[int, list[tuple[str, int]]] = {}
    out: dict[fx.Node, int] = {}
    for spec in kg.inputs:
        if spec.kind not in _WEIGHTS or spec.target not in pins:
            continue
        out[holders[spec.name]] = pins[spec.target]
        t = kg.state.get(spec.target)
        if t is not None:
            by_tensor.setdefault(id(t), []).append((spec.target, pins[spec.target]))
    for spec in kg.inputs:  # a tied name that was not pinned shares its twin's pin
        t = kg.state.get(spec.target) if spec.kind in _WEIGHTS else None
        if t is not None and spec.target not in pins and id(t) in by_tensor:
            by_tensor[id(t)].append((spec.target, None))
    for names in by_tensor.values():
        devices = {d for _, d in names if d is not None}
        if len(devices) > 1:
            listed = ", ".join(f"{n} -> device {d}" for n, d in names if d is not None)
            read = [where(u) for n, _ in names for u in node_of[n].users if where(u)]
            raise AffinityError(
                f"one tensor is pinned to devices {sorted(devices)} under its names "
                f"({listed})", where=read[0] if read else names[0][0],
                hint="tied weights are one tensor: pin them to one device (kiln clones a "
                "weight to every device that reads it)")
    return out


def affinity(kg: KilnGraph, placement: dict[fx.Node, int | None],
             pins: dict[str, int] | None = None) -> Affinity:
    """The devices that need each value, given where each op runs (None: computed
    wherever needed) and the user's pins of state tensors (state name -> device)."""
    pinned = _pinned_weights(kg, pins or {})
    nodes = [n for n in kg.graph.nodes if n.op in ("placeholder", "call_function")]
    place = {n: placement.get(n) for n in nodes if n.op == "call_function"}
    for n, d in place.items():
        if d is None and any(place.get(a) is not None for a in n.all_input_nodes):
            raise VerifierError(f"{n.name} reads a placed value but has no device",
                                where=where(n), hint="a kiln bug in the placement")

    def users(n):
        return [u for u in n.users if u in place]

    def transfer(n, need):
        out = set()
        for u in users(n):
            out |= {place[u]} if place[u] is not None else need[u]
        return frozenset(out)

    fp = solve(reversed(nodes), users, transfer, frozenset())
    need = fp.value
    result = Affinity({n.name: need[n] for n in nodes}, visits=fp.visits)
    kinds = {i.name: i for i in kg.inputs}
    for n in nodes:
        spec = kinds.get(n.name)
        if spec is not None and spec.kind in _WEIGHTS:
            holders = need[n] | ({pinned[n]} if n in pinned else set())
            if len(holders) > 1:
                result.clones[spec.target] = frozenset(holders)
        elif n.op == "call_function" and place[n] is not None:
            away = need[n] - {place[n]}
            if away:
                result.transfers[n.name] = (place[n], frozenset(away))
    return result
