"""A gated delta rule decode step writes its final state into the recurrent state itself.

A model keeps the state in a buffer and writes the step's final state back
(`state[torch.arange(B)] = final`): reinplace makes that an in-place scatter, but
still a kernel of its own that reads the final state the step just wrote (2 MB in
fp32 at Qwen3-Next's 32 value heads of 128 x 128) and writes it again, ~2 us and a
graph gap a layer. The step's kernel already holds each state block in registers:
it stores the block where the scatter would have put it, and the scatter's region
goes (codegen/templates/gated_delta/step_fusion.py).

Folded when the scatter region is an in-place index_put and nothing else (views,
aranges), its values are the step's final state and nothing else reads that, and
every other region reading the state's old value runs before the step (they would
otherwise see the new one). The template checks the rest: it writes the elements
its programs read the old state at, after reading them, or it declines (the region
then runs as torch ops). After reinplace, which decides the scatter is in place;
only targets that generate kernels fold.
"""

from __future__ import annotations

import copy
import logging

from kiln.dispatch.fold_delta_step import is_delta_step
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

SCATTER = "aten.index_put.default"
_PASSIVE = {OpCategory.VIEW, OpCategory.CREATE}


def _final_state(step: Region) -> str | None:
    """The step's final state output (getitem 1 of its op), if it is a region output."""
    anchor = step.anchor()
    for op in step.ops:
        if (op.target == "getitem" and op.args[:2] == (Ref(anchor.name), 1)
                and op.name in step.outputs):
            return op.name
    return None


def _state_write(region: Region, final: str) -> str | None:
    """The state value `region` writes in place with `final`, when that is all it does."""
    if region.kind != RegionKind.COPY or len(region.outputs) != 1:
        return None
    out = region.outputs[0]
    if out not in region.inplace or final not in region.inputs:
        return None
    scatter = region.op(out)
    if scatter.target != SCATTER:
        return None
    if any(o is not scatter and category(o.target) not in _PASSIVE for o in region.ops):
        return None
    return region.inplace[out]


def fold_state_writes(plan: DispatchPlan) -> int:
    """Fold every state write that can be into its step; returns how many were."""
    kept = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    folded = 0
    for step in [r for r in plan.regions if is_delta_step(r, plan)]:
        final = _final_state(step)
        if final is None or final in kept:
            continue
        readers = [r for r in plan.regions if final in r.inputs]
        if len(readers) != 1:
            continue
        writer = readers[0]
        state = _state_write(writer, final)
        if state is None:
            continue
        pos = {r.name: i for i, r in enumerate(plan.regions)}
        late = [r for r in plan.regions if state in r.inputs and r is not step
                and r is not writer and pos[r.name] > pos[step.name]]
        if late:
            continue
        names = {o.name for o in step.ops}
        step.ops += [copy.deepcopy(o) for o in writer.ops if o.name not in names]
        step.inputs = [v for v in dict.fromkeys(step.inputs + writer.inputs) if v != final]
        step.outputs = [writer.outputs[0] if o == final else o for o in step.outputs]
        step.inplace[writer.outputs[0]] = state
        step.notes.append(f"epilogue: writes the final state into %{state} in place "
                          f"(region {writer.name}'s scatter)")
        plan.regions.remove(writer)
        del plan.values[final]
        folded += 1
        log.info("the gated delta step %s writes %s in place (region %s folded)", step.name,
                 state, writer.name)
    return folded


@as_pass
def fold_delta_state(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_state_writes(plan)
    return plan
