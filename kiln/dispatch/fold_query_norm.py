"""Fold a decode query's per-head norm statistics into the attention: one kernel fewer a layer.

Qwen3 and Gemma 3 (and their MoE kin) normalise q per head before RoPE (an RMSNorm over
the head dim). At decode the norm's mean of squares is a reduction region of its own,
~1.5 us and a graph gap a layer, read by the attention alone, whose query tile already
holds each head's whole row: the attention template sums the row on the tile instead
(templates/attention/template.py `_row_sum_at`).

A reduction region folds when its one output is read only by decode attention regions
(one query a head, as recompute_cheap.py reads it) and leaves the program by no other
way, and its ops are one sum or mean over the last dim, keepdim, of a pointwise value
whose last dim is the attention's head dim (not OLMo 2's norm over all heads at once).
The key's norm stays a reduction: the cache write that reads it is a copy kernel
without rows. Only targets that generate kernels fold.
"""

from __future__ import annotations

import logging

from kiln.dispatch.prologue_copy import copy_prologue
from kiln.ir.ops import OpCategory, bind_args, category, norm_axis
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

ROW_SUMS = ("aten.mean.dim", "aten.sum.dim_IntList")
_INLINE = {OpCategory.POINTWISE, OpCategory.VIEW, OpCategory.CREATE}


def head_dim_sum(op) -> Ref | None:
    """The summed value when `op` is a sum or mean over its input's last dim, keepdim."""
    if op.target not in ROW_SUMS:
        return None
    a = bind_args(op)
    src, dims = a["self"], a["dim"]
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    if not isinstance(src, Ref) or not a["keepdim"] or len(dims) != 1 or op.shape is None:
        return None
    if not isinstance(dims[0], int) or norm_axis(dims[0], len(op.shape)) != len(op.shape) - 1:
        return None
    return src


def _query_rows_sum(region: Region) -> bool:
    """A reduction region of one head-dim sum over pointwise ops, one output."""
    if region.kind != RegionKind.REDUCTION or len(region.outputs) != 1 or region.inplace:
        return False
    sums = [o for o in region.ops if category(o.target) == OpCategory.REDUCTION]
    if len(sums) != 1 or sums[0].name != region.outputs[0] or head_dim_sum(sums[0]) is None:
        return False
    return all(category(o.target) in _INLINE for o in region.ops if o is not sums[0])


def _decode_attention_head_dim(region: Region, plan: DispatchPlan) -> int | None:
    """The head dim of a decode attention (one query a head), else None."""
    if region.kind != RegionKind.ATTENTION:
        return None
    q = region.anchor().args[0]
    if not isinstance(q, Ref):
        return None
    shape = plan.values[q.name].shape if q.name in plan.values else region.op(q.name).shape
    if shape is None or len(shape) < 3 or shape[-2] != 1 or not isinstance(shape[-1], int):
        return None
    return shape[-1]


def fold_query_norms(plan: DispatchPlan) -> int:
    """Fold every such reduction region into its attention readers; returns how many."""
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    returned = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    folded = 0
    for region in list(plan.regions):
        if not _query_rows_sum(region):
            continue
        out = region.outputs[0]
        src = head_dim_sum(region.op(out))
        shape = region.op(src.name).shape if src.name in {o.name for o in region.ops} \
            else plan.values[src.name].shape
        users = readers.get(out, [])
        if out in returned or not users or shape is None or any(
                _decode_attention_head_dim(u, plan) != shape[-1] or u.device != region.device
                for u in users):
            continue
        for u in users:
            copy_prologue(u, region, region.ops,
                          f"prologue: the head-dim sum of region {region.name} (%{out}, a "
                          "query norm's statistics) summed on the query tile")
        plan.regions.remove(region)
        del plan.values[out]
        folded += 1
        log.info("folded the query norm's sum %s (%%%s) into %s", region.name, out,
                 ", ".join(u.name for u in users))
    return folded


@as_pass
def fold_query_norm(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_query_norms(plan)
    return plan
