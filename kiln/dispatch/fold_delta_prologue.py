"""Fold the regions computing a gated delta rule decode step's operands into its kernel.

A Qwen3-Next linear-attention layer at decode ran ~10 kernels between its projections
and the step (the causal conv and SiLU, the l2norms of q and k, the gates from b and
a, the fresh-sequence `where` over the 2 MB state), each 1-3 us plus a graph gap, over
a few KB of data; the step's kernel reads every one of those values anyway. Its
template (codegen/templates/gated_delta, step_fusion.py) computes pointwise ops where
it reads its operands, and a reduction over one dim of a row a program reads whole
(the l2norm's sum of squares over a key head), so those regions become its prologue.

A region folds into a step region when every value it produces is read by the step
alone (not returned, not another region's input), it writes nothing in place, and it
is pointwise, or a reduction whose reductions each reduce one dim of static size
(sum, mean, amax, amin). Repeated until nothing changes, so a chain folds producer by
producer (the conv folds once the l2norms reading it have). A value other regions
read too (the conv's input window, also written back as the conv state) stays a plan
value. The step is a kiln::gated_delta_rule of one static step (T = 1, no packed
sequences): the chunked prefill kernel reads its operands tile by tile, many times
over, so its producers stay apart. Only targets that generate kernels fold. A
template that declines the folded region gets the prologues split out again
(codegen/select_kernels.py, dispatch/split.py).
"""

from __future__ import annotations

import copy
import logging

from kiln.ir.ops import OpCategory, bind_args, category, reduction_dims
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

DELTA_OP = "kiln.gated_delta_rule.default"
FOLDABLE_REDUCTIONS = {"aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default",
                       "aten.amin.default"}


def is_delta_step(region: Region, plan: DispatchPlan) -> bool:
    """Is `region` a gated delta rule op of one static step (the decode kernel's)?"""
    if region.kind != RegionKind.EXTERN or region.anchor().target != DELTA_OP:
        return False
    args = list(region.anchor().args) + [None] * 8
    q, cu_seqlens = args[0], args[7]
    if not isinstance(q, Ref) or cu_seqlens is not None:
        return False
    shape = plan.values[q.name].shape if q.name in region.inputs else region.op(q.name).shape
    return shape is not None and len(shape) == 4 and shape[1] == 1


def _computable(producer: Region, plan: DispatchPlan) -> bool:
    """Can a step's kernel compute every op of `producer` where it reads it?"""
    if producer.kind == RegionKind.POINTWISE:
        return True
    if producer.kind != RegionKind.REDUCTION:
        return False
    for op in producer.ops:
        if category(op.target) != OpCategory.REDUCTION:
            continue
        if op.target not in FOLDABLE_REDUCTIONS or not isinstance(op.args[0], Ref):
            return False
        src = op.args[0].name
        shape = plan.values[src].shape if src in producer.inputs else producer.op(src).shape
        if shape is None:
            return False
        dims = reduction_dims(op.target, op.args, op.kwargs, len(shape))
        if len(dims) != 1 or not isinstance(shape[dims[0]], int):
            return False
        if bind_args(op).get("dtype") not in (None, op.dtype):
            return False
    return True


def _fold(plan: DispatchPlan, producer: Region, step: Region) -> None:
    """Move `producer`'s ops into `step` (ahead of its own) and drop `producer`."""
    moved = {o.name for o in producer.ops}
    step.ops = [copy.deepcopy(o) for o in producer.ops] + [
        o for o in step.ops if o.name not in moved]
    used = {r for o in step.ops for r in o.refs()} - {o.name for o in step.ops}
    step.inputs = [v for v in dict.fromkeys(producer.inputs + step.inputs) if v in used]
    step.notes.append(f"prologue: region {producer.name} (%{', %'.join(producer.outputs)}) "
                      "computed in the step's kernel")
    plan.regions.remove(producer)
    for v in producer.outputs:
        del plan.values[v]
    log.info("folded region %s into the gated delta step %s", producer.name, step.name)


def fold_prologues(plan: DispatchPlan) -> int:
    """Fold every producer that can be into the decode steps; returns how many were."""
    steps = [r for r in plan.regions if is_delta_step(r, plan)]
    kept = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    folded = 0
    for step in steps:
        while True:
            producers = plan.producers()
            readers: dict[str, list[Region]] = {}
            for r in plan.regions:
                for v in r.inputs:
                    readers.setdefault(v, []).append(r)
            p = next((producers[v] for v in step.inputs
                      if v in producers and _folds(producers[v], step, readers, kept, plan)),
                     None)
            if p is None:
                break
            _fold(plan, p, step)
            folded += 1
    return folded


def _folds(p: Region, step: Region, readers: dict[str, list[Region]], kept: set[str],
           plan: DispatchPlan) -> bool:
    """May producer region `p` become part of `step`'s prologue?"""
    return (p is not step and not p.inplace and p.device == step.device
            and all(o not in kept and readers.get(o) == [step] for o in p.outputs)
            and _computable(p, plan))


@as_pass
def fold_delta_prologue(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_prologues(plan)
    return plan
