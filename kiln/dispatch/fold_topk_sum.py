"""Fold the sum of a topk's picked values into the topk's kernel: one launch fewer.

A router that renormalises its top-k weights (`w / w.sum(-1, keepdim=True)`: Qwen3-Next,
Qwen-MoE, Mixtral-style `norm_topk_prob`) sums the k values the topk just picked. That
sum is a region of its own (a reduction over k elements: a ~1.1 us kernel and a graph
gap on an H200, a decode MoE layer's fourth launch), while the topk kernel holds those
values in registers when it stores them (templates/topk.py). A reduction region that is
one sum over the topk's own axis of the values it picks, with pointwise ops over the
values' shape (the division, casts) and reading nothing else, joins the topk region:
the kernel sums its picks and stores the sum or the ops' results (a topk kiln does not
generate runs the region as torch ops, the sum among them). Only targets that generate
kernels fold it.
"""

from __future__ import annotations

import logging

from kiln.ir.ops import OpCategory, category, norm_axis, reduction_dims, topk_args
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind
from kiln.ir.symbolic import same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

SUM = "aten.sum.dim_IntList"


def sums_picked_values(op: Op, topk: Region) -> bool:
    """Is `op` a sum over `topk`'s axis of the values `topk` returns?"""
    src = op.args[0] if op.args else None
    if op.target != SUM or not isinstance(src, Ref) or \
            not any(o.name == src.name for o in topk.ops):
        return False
    anchor = topk.anchor()
    got = topk.op(src.name)
    if got.target != "getitem" or got.args[0] != Ref(anchor.name) or got.args[1] != 0:
        return False
    rank = len(got.shape)
    _, dim, _ = topk_args(anchor.target, anchor.args, anchor.kwargs, rank)
    return reduction_dims(op.target, op.args, op.kwargs, rank) == (norm_axis(dim, rank),)


def _epilogue(region: Region, topk: Region) -> bool:
    """Is `region` the sum of `topk`'s picked values and pointwise ops over the values'
    shape (its normalisation w / w.sum(), casts), reading nothing but those values?"""
    sums = [o for o in region.ops if o.target == SUM]
    if len(sums) != 1 or not sums_picked_values(sums[0], topk):
        return False
    values = sums[0].args[0].name
    if region.inputs != [values]:
        return False
    picked = topk.op(values).shape
    return all(o is sums[0] or (category(o.target) == OpCategory.POINTWISE
                                and len(o.shape) == len(picked)
                                and all(same_dim(a, b) for a, b in zip(o.shape, picked)))
               for o in region.ops)


def _read_elsewhere(plan: DispatchPlan, value: str, topk: Region) -> bool:
    """Does a region besides `topk`, or the program's caller, read `value`?"""
    returned = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    return value in returned or any(value in r.inputs for r in plan.regions if r is not topk)


def fold_topk_sums(plan: DispatchPlan) -> int:
    """Move every such region into its topk region; returns how many were."""
    producer = {o: r for r in plan.regions for o in r.outputs}
    folded = 0
    for region in list(plan.regions):
        if region.kind != RegionKind.REDUCTION or len(region.inputs) != 1:
            continue
        topk = producer.get(region.inputs[0])
        if topk is None or topk.kind != RegionKind.TOPK or topk.device != region.device \
                or not _epilogue(region, topk):
            continue
        topk.ops.extend(region.ops)
        topk.outputs.extend(region.outputs)
        plan.regions.remove(region)
        values = region.inputs[0]
        if not _read_elsewhere(plan, values, topk):  # the kernel keeps them in registers
            topk.outputs.remove(values)
            del plan.values[values]
        topk.notes.append(f"epilogue: region {region.name} (the sum of the picked values"
                          f"{' and ops over them' if len(region.ops) > 1 else ''}) computed "
                          "and stored by this kernel")
        folded += 1
        log.info("folded %s (the sum of topk %s's values) into it", region.name, topk.name)
    return folded


@as_pass
def fold_topk_sum(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_topk_sums(plan)
    return plan
