"""Cache writes side by side in one launch: a decode step's K and V rows.

A Llama layer writes its new key (RoPE applied) and value into their caches as two
in-place scatters at the same positions, two copy kernels of ~1 us each on an H200
and a graph gap between them, for 2 KB apiece at Llama-3-8B's widths. Two adjacent
copy regions that are each one in-place index_put or index_copy over rows of the
same shape become one region: the copy template walks the update
once and stores both (templates/copy.py). Only regions next to each other in the
plan merge (nothing between them can read a cache the second would write earlier),
and only where neither reads the other's output; only targets that generate kernels.
"""

from __future__ import annotations

import logging

from kiln.dispatch.group_siblings import merged_ops
from kiln.ir.ops import OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.ir.symbolic import same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

# the scatters a cache write is, and the argument holding the rows written
WRITES = {"aten.index_put.default": "values", "aten.index_copy.default": "source"}


def _cache_write(region: Region):
    """(device, the written rows' shape) of a copy region that is one in-place,
    non-accumulating index_put or index_copy whose rows it computes; None otherwise."""
    if region.kind != RegionKind.COPY:
        return None
    scatters = [o for o in region.ops if category(o.target) == OpCategory.SCATTER]
    if len(scatters) != 1 or region.outputs != [scatters[0].name]:
        return None
    op = scatters[0]
    if op.target not in WRITES or op.name not in region.inplace:
        return None
    a = bind_args(op)
    values = a[WRITES[op.target]]
    if a.get("accumulate") or not isinstance(values, Ref) or \
            not any(o.name == values.name for o in region.ops):
        return None
    return region.device, tuple(region.op(values.name).shape)


def _same_write(a, b) -> bool:
    """The same device and values of one shape: the template walks one update for both
    (each store keeps its own indices) and declines if their updates differ."""
    (da, sa), (db, sb) = a, b
    return da == db and len(sa) == len(sb) and all(same_dim(x, y) for x, y in zip(sa, sb))


def _crossed(first: Region, second: Region) -> bool:
    """Does either write a state the other writes or reads? In one kernel a program
    could then load what another program's store has already replaced."""
    dest_a, dest_b = set(first.inplace.values()), set(second.inplace.values())
    return bool(dest_a & dest_b or dest_a & set(second.inputs) or dest_b & set(first.inputs))


def group_cache_writes_of(plan: DispatchPlan) -> int:
    """Merge each pair of adjacent matching cache writes; returns how many regions went."""
    merged, i = 0, 0
    while i + 1 < len(plan.regions):
        first, second = plan.regions[i], plan.regions[i + 1]
        wa, wb = _cache_write(first), _cache_write(second)
        if wa is None or wb is None or not _same_write(wa, wb) \
                or set(second.inputs) & set(first.outputs) \
                or _crossed(first, second):
            i += 1
            continue
        ops = merged_ops([first, second])
        if ops is None:
            i += 1
            continue
        first.ops = ops
        first.inputs = list(dict.fromkeys(first.inputs + second.inputs))
        first.outputs = first.outputs + second.outputs
        first.inplace = {**first.inplace, **second.inplace}
        first.notes.append(f"cache writes: region {second.name}'s write at the same "
                           "positions stored by this kernel too")
        plan.regions.remove(second)
        merged += 1
        log.info("grouped the cache writes of %s into %s", second.name, first.name)
        i += 1
    return merged


@as_pass
def group_cache_writes(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        group_cache_writes_of(plan)
    return plan
