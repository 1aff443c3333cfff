"""Group sibling fp8 decode GEMVs into one region: the block-scaled linears of one input.

group_siblings.py does this for fp16/bf16 matmul regions; a block-scaled fp8 linear
(kiln::fp8_linear: DeepSeek-V3's projections, a Llama loaded with quantize="fp8") is
an extern region of its own, and at one token each runs fp8_matmul's CUDA-core GEMV,
whose start latency, split merge and epilogue cost every launch a few microseconds
over its bytes (V3's q_a_proj and kv_a_proj_with_mqa of one normed x: 11 and 4 MB,
8.6 and 5.3 us on an H100). Grouped, the siblings' weights stay the user's tensors
(one kernel reads them all, through their own pointers), and x is read and quantised
per 128-block in the programs that stream them, as in the plain GEMV:

- independent siblings (q_a and kv_a; q, k and v) become one extern region with each
  sibling's output: fp8_matmul/grouped.py splits its programs over the siblings'
  column ranges, each choosing its weight and scales once, before its K loop;
- two siblings whose outputs only one pointwise region reads (SiLU(gate) * up: the
  fp8 linear has no epilogue, so the product goes through memory to a kernel of
  its own) are paired into that region, which becomes an extern region holding both
  products and the pointwise ops: one program streams both weights at the same
  columns, quantising x once for the two, and runs the pointwise ops on its tile;
  neither product is stored.

Siblings: extern regions holding one kiln::fp8_linear (and the views of x it reads
through) with at most FP8_GEMV_MAX_M tokens, whose weight and scales are region
inputs, the same x (computed by the same ops from the same values), K, tokens and
dtype. A region writing a state, or on another device, is left alone, as is a
product anything else reads (or that leaves the plan). Only targets that generate
kernels group. The grouped or paired kernel is then the tuner's question, as for
the fp16 siblings: select_kernels splits the region apart again (dispatch/split.
split_siblings, the pointwise ops back into a region of their own) when the template
declines it or when, timed, the products apart win.
"""

from __future__ import annotations

import logging

from kiln.dispatch.fold_rmsnorm import FP8_GEMV_MAX_M
from kiln.dispatch.group_siblings import (
    FP8_LINEAR,
    _Sibling,
    families_of,
    group_side_by_side,
    merged_ops,
    readers_of,
    returned_values,
)
from kiln.dispatch.rmsnorm_prologue import closure
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.ir.symbolic import bounds_of, numel, same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")



def _sibling(region: Region, plan: DispatchPlan) -> _Sibling | None:
    """`region` as an fp8 sibling candidate, or None when it cannot be grouped."""
    if region.kind != RegionKind.EXTERN or region.inplace or len(region.outputs) != 1:
        return None
    if region.outputs[0] in plan.state_writes.values():
        return None
    fp8 = [o for o in region.ops if o.target == FP8_LINEAR]
    if len(fp8) != 1 or fp8[0].name != region.outputs[0]:
        return None
    anchor = fp8[0]
    x, weight, scale = anchor.args[:3]
    if not all(isinstance(a, Ref) for a in (x, weight, scale)):
        return None
    if weight.name not in region.inputs or scale.name not in region.inputs:
        return None
    ops = {o.name: o for o in region.ops}
    x_shape = (ops[x.name] if x.name in ops else plan.values[x.name]).shape
    m = numel(tuple(x_shape[:-1]))
    rows = bounds_of(m, plan.symbols).hi
    if rows is None or rows > FP8_GEMV_MAX_M:
        return None
    left = [o for o in region.ops if o.name in closure(ops, x.name)]
    return _Sibling(region, anchor, x.name, left, weight.name, x_shape[-1], m)


def group_fp8_siblings_of(plan: DispatchPlan) -> int:
    """Pair and group every family of fp8 siblings that can be; returns how many
    regions went."""
    readers, returned = readers_of(plan), returned_values(plan)
    before = len(plan.regions)
    for family in families_of(plan, _sibling):
        side_by_side = _pair(plan, family, readers, returned)
        if len(side_by_side) > 1:
            group_side_by_side(plan, side_by_side)
    return before - len(plan.regions)


def _pair(plan: DispatchPlan, family: list[_Sibling], readers, returned) -> list[_Sibling]:
    """Merge each two siblings of one width whose products only one pointwise region
    reads into that region; returns the siblings left to group side by side."""
    left, states = list(family), set(plan.state_writes.values())
    for first in family:
        if first not in left:
            continue
        reader = _only_reader(first, readers, returned)
        if reader is None or reader.inplace or set(reader.outputs) & states:
            continue  # pointwise ops that write a state (reinplace may): a region apart
        second = next((s for s in left if s is not first
                       and _only_reader(s, readers, returned) is reader
                       and same_dim(s.anchor.shape[-1], first.anchor.shape[-1])), None)
        if second is not None and _pair_into(plan, first, second, reader):
            left = [s for s in left if s is not first and s is not second]
    return left


def _only_reader(s: _Sibling, readers, returned) -> Region | None:
    out = s.region.outputs[0]
    users = readers.get(out, [])
    if out in returned or len(users) != 1 or users[0].kind != RegionKind.POINTWISE:
        return None
    return users[0]


def _pair_into(plan: DispatchPlan, first: _Sibling, second: _Sibling, reader: Region) -> bool:
    ops = merged_ops([first.region, second.region, reader])
    if ops is None:
        return False
    products = [first.anchor.name, second.anchor.name]
    reader.ops = ops
    reader.inputs = [v for v in dict.fromkeys(first.region.inputs + second.region.inputs
                                              + reader.inputs) if v not in products]
    reader.kind = RegionKind.EXTERN
    reader.label = None
    reader.notes.append(f"siblings: the fp8 products of regions {first.region.name} and "
                        f"{second.region.name} (%{products[0]}, %{products[1]}, read only "
                        "here) computed here, side by side in one GEMV, before this "
                        "region's pointwise ops")
    for s in (first, second):
        plan.regions.remove(s.region)
        del plan.values[s.anchor.name]
    log.info("paired the fp8 GEMVs of %s and %s into %s", first.region.name,
             second.region.name, reader.name)
    return True


@as_pass
def group_fp8_siblings(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        group_fp8_siblings_of(plan)
    return plan
