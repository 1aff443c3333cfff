"""Write state updates in place: a KV-cache write touches T rows, not the whole cache.

The functional graph returns a buffer's new value (index_put on the old one); a copy
back after every call would move the entire cache. When the scatter's destination is
the state value itself and every other reader of the old value can run first, the
region writes the state's storage directly (`Region.inplace`) and regions are
reordered so those readers come first. A one-element state a pointwise region
recomputes whole (a cache's position counter) is written in place too. Otherwise the
functional form and the copy back stay: slower, never wrong.
"""

from __future__ import annotations

import dataclasses
import logging

from kiln.ir.ops import INPLACE_OF
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind, Role
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")


def _depends_on(plan: DispatchPlan, region: Region, writer: Region) -> bool:
    """Does `region` read, transitively, anything `writer` produces?"""
    producers = plan.producers()
    stack, seen = list(region.inputs), set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        r = producers.get(v)
        if r is None:
            continue
        if r is writer:
            return True
        stack.extend(r.inputs)
    return False


def _move_before(plan: DispatchPlan, readers: list[Region], writer: Region) -> None:
    """Reorder so `readers` (and what they need) run before `writer`; a stable topo sort."""
    regions = plan.regions
    pos = {r.name: i for i, r in enumerate(regions)}
    producers = plan.producers()
    must_precede: set[str] = set()
    stack = list(readers)
    while stack:
        r = stack.pop()
        if r.name in must_precede or pos[r.name] < pos[writer.name]:
            continue
        must_precede.add(r.name)
        stack.extend(producers[v] for v in r.inputs if v in producers)
    if not must_precede:
        return
    i = pos[writer.name]
    moved = [r for r in regions[i:] if r.name in must_precede]
    rest = [r for r in regions[i:] if r.name not in must_precede]
    plan.regions = regions[:i] + moved + rest


def _overwrites_one_element(plan: DispatchPlan, writer: Region, state: str,
                            value: str) -> bool:
    """A one-element state (transformers' StaticCache's `cumulative_length` counter)
    that `writer`, a pointwise region not reading it, recomputes whole: its kernel can
    store into the state's storage (one element: no layout to disagree on), and the
    copy back after each call (a kernel of its own on a GPU) goes."""
    new, old = plan.values[value], plan.values[state]
    return (writer.kind == RegionKind.POINTWISE and state not in writer.inputs
            and new.dtype == old.dtype and new.numel == 1 and old.numel == 1)


def try_reinplace(plan: DispatchPlan, state: str, value: str) -> bool:
    producers = plan.producers()
    writer = producers.get(value)
    if writer is None or len(writer.outputs) != 1:
        return False
    op = writer.op(value)
    scatter = op.target in INPLACE_OF and op.args and op.args[0] == Ref(state)
    if not scatter and not _overwrites_one_element(plan, writer, state, value):
        return False
    if any(o.name != value and Ref(state) in o.args for o in writer.ops):
        return False  # the region itself reads the old value elsewhere
    readers = [r for r in plan.regions if r is not writer and state in r.inputs]
    if any(_depends_on(plan, r, writer) for r in readers):
        return False  # someone needs both the old and the new value
    _move_before(plan, readers, writer)
    if value in writer.inplace:  # one value, two states (CSE merged their updates)
        value = _second_output(plan, writer, value)
    writer.inplace[value] = state
    return True


def _second_output(plan: DispatchPlan, writer: Region, value: str) -> str:
    """A copy of `value`'s op under a new name, a second output of `writer`: each
    state written in place needs its own store (only one-element values get here)."""
    op = writer.op(value)
    name, i = f"{value}_again", 1
    while name in plan.values or any(o.name == name for o in writer.ops):
        i += 1
        name = f"{value}_again{i}"
    writer.ops.append(dataclasses.replace(op, name=name))
    writer.outputs.append(name)
    plan.values[name] = dataclasses.replace(plan.values[value], name=name, role=Role.TEMP)
    return name


@as_pass
def reinplace(plan: DispatchPlan, ctx) -> DispatchPlan:
    for state_target, value in list(plan.state_writes.items()):
        state = next((v.name for v in plan.values.values()
                      if v.role == Role.STATE and v.target == state_target), None)
        if state is None or plan.values[value].role == Role.OUTPUT:
            continue
        if try_reinplace(plan, state, value):
            del plan.state_writes[state_target]
            log.info("state %s is updated in place by %%%s", state_target, value)
        else:
            log.info("state %s is copied back after each call", state_target)
    return plan
