"""Fold a decode step's K/V cache writes into the attention that reads them: one kernel
fewer a layer.

After group_cache_writes a Llama layer still writes its new key (RoPE applied) and value
rows in a copy kernel of its own, ~1.7 us and a graph gap a layer on an H200 for 2 KB
apiece, before the attention reads the caches (benchmarks/RESULTS.md, the decode
profile). The attention's programs already hold the tile's batch and kv head; the one
whose key range holds the written position stores the row (RoPE computed from the
projection on the way, as the copy kernel did) before its key loop reads it, so no other
program can read the row before it is written (templates/attention/template.py
`_cache_writes`).

A copy region folds when it is only in-place index_copy / index_put scatters of one
position a row (a decode step's) and what computes their rows, its outputs are
read by one attention region of one query a head (decode) and by nothing else in the
step, and no region between the two writes what it reads or the caches. The template
checks the rest (the written dim is the attention's key axis, the rows are the tile's
heads) and declines otherwise; the writes then come back out as the copy region they
were (`unfold_cache_writes`). Only targets that generate kernels fold.
"""

from __future__ import annotations

import copy
import logging

from kiln.dispatch.fold_query_norm import _decode_attention_head_dim
from kiln.dispatch.group_cache_writes import WRITES
from kiln.dispatch.split import _closure, _fresh_name, _inputs_of
from kiln.ir.ops import OpCategory, bind_args, category, norm_axis
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

NOTE = "cache writes folded in: region {} (the step's new key and value rows)"
_ROWS = {OpCategory.POINTWISE, OpCategory.VIEW, OpCategory.CREATE, OpCategory.GATHER,
         OpCategory.CONCAT}


def one_row_writes(region: Region) -> list | None:
    """The scatters of a copy region that is only one-row in-place cache writes (and the
    ops computing their rows); None otherwise."""
    if region.kind != RegionKind.COPY:
        return None
    scatters = [o for o in region.ops if category(o.target) == OpCategory.SCATTER]
    if not scatters or region.outputs != [o.name for o in scatters]:
        return None
    ops = {o.name: o for o in region.ops}
    for op in scatters:
        if op.target not in WRITES or op.name not in region.inplace or op.shape is None:
            return None
        a = bind_args(op)
        rows = a[WRITES[op.target]]
        if a.get("accumulate") or not isinstance(rows, Ref) or rows.name not in ops or \
                not _one_position(ops[rows.name].shape, op, a):
            return None
    if any(category(o.target) not in _ROWS for o in region.ops if o not in scatters):
        return None
    return scatters


def _one_position(values_shape, op, a) -> bool:
    """Does the scatter write one position a row: index_copy's source one long on its
    dim; an index_put's values of a size-1 dim before the last, or of fewer dims than
    the cache (kiln's own cache `cache[rows, input_pos] = k` at decode: [B, 1, KV, D],
    or [KV, D] broadcast at a batch of 1). The template checks the written rows lie
    along the attention's keys."""
    if values_shape is None:
        return False
    if op.target == "aten.index_copy.default":
        return values_shape[norm_axis(a["dim"], len(op.shape))] == 1
    # values broadcast over the indexed rows (a batch of 1: [KV, D] into [1, 1, KV, D])
    return len(values_shape) < len(op.shape) or any(d == 1 for d in values_shape[:-1])


def fold_cache_writes_of(plan: DispatchPlan) -> int:
    """Fold every such copy region into its attention; returns how many."""
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    returned = set(plan.outputs) | {v for v, _ in plan.send}
    folded = 0
    for region in list(plan.regions):
        scatters = one_row_writes(region)
        if scatters is None:
            continue
        users = {u.name: u for out in region.outputs for u in readers.get(out, [])}
        if len(users) != 1 or returned & set(region.outputs):
            continue
        attention = next(iter(users.values()))
        if (_decode_attention_head_dim(attention, plan) is None
                or attention.device != region.device
                or not _nothing_between(plan, region, attention)):
            continue
        _fold(region, attention)
        plan.regions.remove(region)
        folded += 1
        log.info("folded the cache writes of %s into %s", region.name, attention.name)
    return folded


def _nothing_between(plan: DispatchPlan, first: Region, later: Region) -> bool:
    """Can `first` run inside `later`? No region between writes what it reads or the
    states it writes (its outputs are read by `later` alone)."""
    i, j = plan.regions.index(first), plan.regions.index(later)
    if j < i:
        return False
    touched = set(first.inputs) | set(first.inplace.values())
    for r in plan.regions[i + 1:j]:
        if touched & (set(r.inplace.values()) | set(r.outputs)):
            return False
    return True


def _fold(writes: Region, attention: Region) -> None:
    attention.ops = writes.ops + attention.ops
    attention.inputs = list(dict.fromkeys(
        writes.inputs + [v for v in attention.inputs if v not in writes.outputs]))
    attention.outputs = attention.outputs + writes.outputs
    attention.inplace = {**attention.inplace, **writes.inplace}
    attention.notes.append(NOTE.format(writes.name))
    attention.folded_writes = writes.name


def unfold_cache_writes(plan: DispatchPlan, attention: Region, why: str) -> bool:
    """Put folded cache writes back as a copy region before `attention` (its template
    declined them): the writes with every op computing their rows, among them the
    prologues recomputed in the attention since (recompute_cheap), which the attention
    keeps where it reads them too. False if it has none."""
    if attention.folded_writes is None:
        return False
    scatters = [o.name for o in attention.ops if category(o.target) == OpCategory.SCATTER]
    ops = [copy.deepcopy(o) for o in _closure(attention, scatters, set())]
    kept = _closure(attention, attention.outputs[:1], set(scatters))
    writes = Region(_fresh_name(plan, attention.folded_writes), RegionKind.COPY, ops,
                    _inputs_of(ops, attention.inputs), scatters,
                    inplace={k: v for k, v in attention.inplace.items() if k in scatters},
                    device=attention.device,
                    notes=[f"the cache writes folded into region {attention.name}, apart "
                           f"again: {why}"])
    attention.ops = kept
    attention.outputs = attention.outputs[:1]
    attention.inplace = {k: v for k, v in attention.inplace.items() if k not in scatters}
    attention.inputs = _inputs_of(kept, attention.inputs + scatters) + \
        [b for b in attention.key_bound_values() if b in attention.inputs]
    attention.notes = [n for n in attention.notes if n != NOTE.format(attention.folded_writes)]
    attention.notes.append(f"the cache writes run apart (region {writes.name}): {why}")
    attention.folded_writes = None
    plan.regions.insert(plan.regions.index(attention), writes)
    return True


@as_pass
def fold_cache_writes(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_cache_writes_of(plan)
    return plan
