"""A monotone fixed point over a finite lattice: the solver behind kiln's analyses that
propagate facts across a graph (which devices need a value, which stage runs an op).

IREE's affinity analysis iterated whole-graph sweeps with a cap and gave up at it
(DESIGN.md failure 2): a chain of N ops needed N sweeps. Here a worklist revisits only
the nodes whose inputs changed, and each visit may only move a node's value up a
finite lattice, so the solver ends by construction: no cap, at most (lattice height x
nodes) updates, one visit per node for a chain in order. A transfer function that
moves a value down is a kiln bug and says so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from kiln.errors import VerifierError


@dataclass
class FixedPoint:
    value: dict  # node -> its value at the fixed point
    visits: int  # transfer-function evaluations it took


def solve(nodes: Iterable[Hashable], reads: Callable[[Hashable], Iterable[Hashable]],
          transfer: Callable, bottom, leq: Callable = lambda a, b: a <= b) -> FixedPoint:
    """The least fixed point: value[n] = transfer(n, value) for every node.

    `reads(n)` are the nodes whose values n's transfer function looks at; `transfer(n,
    value)` computes n's value from the current `value` dict (it must be monotone: a
    larger input never gives a smaller output). Values start at `bottom`; `leq` is the
    lattice order (set inclusion by default).
    """
    order = list(nodes)
    value = {n: bottom for n in order}
    readers: dict[Hashable, list[Hashable]] = {n: [] for n in order}
    for n in order:
        for m in reads(n):
            readers.setdefault(m, []).append(n)
    queue = deque(order)
    queued = set(order)
    visits = 0
    while queue:
        n = queue.popleft()
        queued.discard(n)
        visits += 1
        new = transfer(n, value)
        old = value[n]
        if new == old:
            continue
        if not leq(old, new):
            raise VerifierError(
                f"a fixed-point analysis moved {n} down its lattice ({old!r} -> {new!r})",
                hint="a transfer function is not monotone; this is a kiln bug, report it")
        value[n] = new
        for r in readers.get(n, ()):
            if r not in queued:
                queue.append(r)
                queued.add(r)
    return FixedPoint(value, visits)
