"""Fold the regions around a gated delta rule decode step into its kernel: those computing
its operands (a prologue) and the one normalising its output (an epilogue).

A Qwen3-Next linear-attention layer at decode ran ~10 kernels between its projections
and the output projection (the causal conv and SiLU, the l2norms of q and k, the gates
from b and a, the fresh-sequence `where` over the 2 MB state, the step, the gated
RMSNorm of its output), each 1-3 us plus a graph gap, over a few KB of data; the
step's kernel reads every one of those values anyway. Its template
(codegen/templates/gated_delta, step_fusion.py) computes pointwise ops where it reads
its operands, and a reduction over one dim of a row a program holds whole (the
l2norm's sum of squares over a key head; the gated norm's over a value head, with a
config whose value block is the whole head), so those regions join the step.

A region folds in as a prologue when every value it produces is read by the step
alone (not returned, not another region's input), it writes nothing in place, and it
is pointwise, or a reduction whose reductions each reduce one dim of static size (sum,
mean, amax, amin). Repeated until nothing changes, so a chain folds producer by
producer (the conv folds once the l2norms reading it have). A value other regions read
too (the conv's input window, also written back as the conv state) stays a plan value.
A region folds in as an epilogue when it is the only reader of the step's output o,
is such a region itself, produces one value of o's shape (stored where o would be),
and reads nothing produced after the step.

The step is a kiln::gated_delta_rule of one static step (T = 1, no packed sequences):
the chunked prefill kernel reads its operands tile by tile, many times over, so its
neighbours stay apart. Only targets that generate kernels fold. A template that
declines a folded prologue gets it split out again (codegen/select_kernels.py,
dispatch/split.py).
"""

from __future__ import annotations

import copy
import logging

from kiln.ir.ops import OpCategory, bind_args, category, reduction_dims
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.ir.symbolic import same_dim
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


def _computable(region: Region, plan: DispatchPlan) -> bool:
    """Can a step's kernel compute every op of `region` where it reads it?"""
    if region.kind == RegionKind.POINTWISE:
        return True
    if region.kind != RegionKind.REDUCTION:
        return False
    for op in region.ops:
        if category(op.target) != OpCategory.REDUCTION:
            continue
        if op.target not in FOLDABLE_REDUCTIONS or not isinstance(op.args[0], Ref):
            return False
        src = op.args[0].name
        shape = plan.values[src].shape if src in region.inputs else region.op(src).shape
        if shape is None:
            return False
        dims = reduction_dims(op.target, op.args, op.kwargs, len(shape))
        if len(dims) != 1 or not isinstance(shape[dims[0]], int):
            return False
        if bind_args(op).get("dtype") not in (None, op.dtype):
            return False
    return True


def _merge(plan: DispatchPlan, other: Region, step: Region, before: bool, note: str) -> None:
    """Move `other`'s ops into `step` (ahead of its own, or after them) and drop it."""
    theirs = [copy.deepcopy(o) for o in other.ops]
    if before:
        names = {o.name for o in theirs}
        step.ops = theirs + [o for o in step.ops if o.name not in names]
    else:
        names = {o.name for o in step.ops}
        step.ops = step.ops + [o for o in theirs if o.name not in names]
    used = {r for o in step.ops for r in o.refs()} - {o.name for o in step.ops}
    step.inputs = [v for v in dict.fromkeys(other.inputs + step.inputs) if v in used]
    step.notes.append(note)
    plan.regions.remove(other)
    log.info("folded region %s into the gated delta step %s", other.name, step.name)


def _readers(plan: DispatchPlan) -> dict[str, list[Region]]:
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    return readers


def _kept(plan: DispatchPlan) -> set[str]:
    """Values the plan returns, writes back or sends: they stay plan values."""
    return set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}


def _prologue(p: Region, step: Region, readers, kept: set[str], plan: DispatchPlan) -> bool:
    """May producer region `p` become part of `step`'s prologue?"""
    return (p is not step and not p.inplace and p.device == step.device
            and all(o not in kept and readers.get(o) == [step] for o in p.outputs)
            and _computable(p, plan))


def fold_prologues(plan: DispatchPlan, step: Region) -> int:
    """Fold every producer of `step` that can be; returns how many were."""
    folded = 0
    kept = _kept(plan)
    while True:
        producers, readers = plan.producers(), _readers(plan)
        p = next((producers[v] for v in step.inputs
                  if v in producers and _prologue(producers[v], step, readers, kept, plan)),
                 None)
        if p is None:
            return folded
        _merge(plan, p, step, True, f"prologue: region {p.name} "
               f"(%{', %'.join(p.outputs)}) computed in the step's kernel")
        for v in p.outputs:
            del plan.values[v]
        folded += 1


def fold_epilogue(plan: DispatchPlan, step: Region) -> bool:
    """Fold the one region reading the step's output o, if it can be; True if it was."""
    anchor = step.anchor()
    o = next((op for op in step.ops if op.target == "getitem"
              and op.args[:2] == (Ref(anchor.name), 0) and op.name in step.outputs), None)
    readers = _readers(plan).get(o.name, []) if o is not None else []
    if o is None or o.name in _kept(plan) or len(readers) != 1:
        return False
    e = readers[0]
    producers, pos = plan.producers(), {r.name: i for i, r in enumerate(plan.regions)}
    late = [v for v in e.inputs if v in producers and v != o.name
            and pos[producers[v].name] > pos[step.name]]
    out = plan.values[e.outputs[0]] if len(e.outputs) == 1 else None
    if (late or e.inplace or e.device != step.device or out is None
            or not _computable(e, plan) or len(out.shape) != len(o.shape)
            or not all(same_dim(a, b) for a, b in zip(out.shape, o.shape))):
        return False
    _merge(plan, e, step, False, f"epilogue: region {e.name} (%{out.name}) computed from "
           "the step's output in its kernel")
    step.outputs = [out.name if v == o.name else v for v in step.outputs]
    del plan.values[o.name]
    return True


@as_pass
def fold_delta_step(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        for step in [r for r in plan.regions if is_delta_step(r, plan)]:
            fold_prologues(plan, step)
            fold_epilogue(plan, step)
    return plan
