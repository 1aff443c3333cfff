"""Recompute a small cheap value in each region that reads it: one launch fewer.

Grouping fuses a producer into its consumer only when every consumer is in one group,
so a value read by two regions is stored by a region of its own even when it is one
cast of a slice: DeepSeek-V3's decode layer cast its [1, 512] latent (`kv.to(...)` of
a slice of kv_a's output) in a kernel of ~1.2 us, plus a graph gap, for its norm's
reduction and its cache write to read. A pointwise region of views, creates, gathers
and cheap ops (recompute.CHEAP: casts, adds, compares, selects) whose one output is
small (MAX_ELEMENTS) and read only by regions that compute their prologue per element
(pointwise, reduction, copy, topk: V3's router bias read by its two topks; a decode
attention: the rotary tables read at the step's position, `cos[pos].to(dtype)`, that
a decode step's key cache write and attention both read, two or three kernels a step in
HF- and gpt-fast-style models; an H200 step measured no faster, only fewer launches: the
gather's round trip moves into its readers), is copied into each of them instead and
goes. Not when
the output leaves the program, or when an input is a state some region writes in place
(a later reader would see the new state). One reader is enough where it took over
another's work (a decode attention with its cache write folded in). Only targets that
generate kernels.
"""

from __future__ import annotations

import logging

from kiln.dispatch.fold_delta_step import DELTA_OP
from kiln.dispatch.prologue_copy import copy_prologue
from kiln.dispatch.recompute import CHEAP
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.ir.symbolic import numel
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

MAX_ELEMENTS = 1 << 16  # a recomputed value's size (each reader computes what it reads)
_READERS = {RegionKind.POINTWISE, RegionKind.REDUCTION, RegionKind.COPY, RegionKind.TOPK}
_FREE = {OpCategory.VIEW, OpCategory.CREATE}
# a gather (a rotary table read at the step's positions) is recomputed too, one
# dependent load where it is read
_RECOMPUTED = _FREE | {OpCategory.GATHER}


def _reads_per_element(region: Region, plan: DispatchPlan) -> bool:
    """Does `region`'s kernel compute its prologue at each element it reads? Pointwise,
    reduction, copy and topk regions do, and so does a fused gated delta decode step
    (its prologue is computed where it reads its operands: templates/gated_delta) and a
    decode attention (one query a head: its prologue runs on the query tile once; a
    prefill's key prologue runs every key step, where a gather would wait in the loop)."""
    if region.kind == RegionKind.ATTENTION:
        q = region.anchor().args[0]
        if not isinstance(q, Ref):
            return False
        shape = plan.values[q.name].shape if q.name in plan.values else region.op(q.name).shape
        return shape is not None and len(shape) >= 2 and shape[-2] == 1
    return region.kind in _READERS or (
        region.kind == RegionKind.EXTERN and region.anchor().target == DELTA_OP)


def _took_over_a_reader(users: list[Region]) -> bool:
    """One reader that took over another reader's work (a decode attention with the
    cache write folded in, dispatch/fold_cache_writes.py): it was read twice."""
    return len(users) == 1 and users[0].folded_writes is not None


def _cheap(region: Region) -> bool:
    """A pointwise region of one output whose every op is a view, a create, a gather or
    cheap (a gather alone, uncast, is a copy region)."""
    return (region.kind in (RegionKind.POINTWISE, RegionKind.COPY) and
            len(region.outputs) == 1 and
            not region.inplace and
            all(category(o.target) in _RECOMPUTED or o.target in CHEAP for o in region.ops))


def recompute_cheap_values(plan: DispatchPlan) -> int:
    """Copy every such region into its readers; returns how many went."""
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    # states written in place, and the in-place outputs that alias them
    written = {v for r in plan.regions for pair in r.inplace.items() for v in pair}
    written |= set(plan.state_writes)
    returned = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    gone = 0
    for region in list(plan.regions):
        if not _cheap(region):
            continue
        out = region.outputs[0]
        size = numel(plan.values[out].shape)
        users = readers.get(out, [])
        if (out in returned or not isinstance(size, int) or size > MAX_ELEMENTS
                or len(users) < 2 and not _took_over_a_reader(users)
                or set(region.inputs) & written
                or any(not _reads_per_element(u, plan) or u.device != region.device
                       for u in users)):
            continue
        for u in users:
            copy_prologue(u, region, region.ops,
                          f"prologue: region {region.name} (%{out}, cheap) recomputed here")
            for v in region.inputs:
                readers.setdefault(v, []).append(u)
        plan.regions.remove(region)
        del plan.values[out]
        gone += 1
        log.info("recomputed %s (%%%s) in %s", region.name, out,
                 ", ".join(u.name for u in users))
    return gone


@as_pass
def recompute_cheap(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        recompute_cheap_values(plan)
    return plan
