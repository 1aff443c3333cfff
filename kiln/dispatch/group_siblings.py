"""Group sibling decode GEMVs into one region: one kernel launch where there were several.

A model written with separate projections of one input (HF Llama's q_proj, k_proj,
v_proj of one normed x; gate_proj and up_proj of another) gets a matmul region per
projection, and at decode each is a GEMV kernel. On an H100 every decode GEMV costs
4-5 us over its bytes whatever its size (start latency, split merge, epilogue), so
kiln.models' Llama pays ~3 x 4.5 us a layer more than a model with fused wqkv / w13.
Concatenating the weights would double them in memory (they are the user's), so the
siblings stay separate tensors and one kernel reads them all:

- independent siblings (q, k, v: no sibling reads another's output) become one region
  with each sibling's output (and its own epilogue); the matmul template's grouped
  GEMV (codegen/templates/matmul/grouped.py) splits its programs over the siblings'
  column ranges, each choosing its weight once, before its K loop;
- a sibling whose epilogue reads another's product (SwiGLU over separate gate and up
  projections: silu(x @ Wg) * (x @ Wu), the other's output read by nothing else)
  absorbs it: one region with two products, which the GEMV form computes at the same
  columns in one program (as it does for gpt-fast's chunked w13), so the product
  read in the epilogue is never stored.

Siblings: matmul regions with one mm / addmm each, at most gemv_max_rows rows (the GEMV
form's), the same rows, K and dtype, weights of one dtype read through views only, and
a left operand computed by the same ops from the same values (an RMSNorm that
fold_rmsnorm copied into each is then computed once). A region that writes in place
or updates a state tensor, or sits on another device, is left alone, as is a sibling
whose output also feeds anything besides the one that absorbs it. The grouped
region takes the first sibling's place in the plan (every sibling's inputs are
produced by then, or it is not grouped). Only targets that generate kernels group:
the CPU target runs torch ops, one per product either way. Whether the grouped
kernel is the faster is the tuner's question: select_kernels splits a group apart
again (dispatch/split.split_siblings) when its template declines it or when, timed,
the separate products win.
"""

from __future__ import annotations

import copy
import logging

from kiln.dispatch.fold_rmsnorm import gemv_max_rows
from kiln.dispatch.rmsnorm_prologue import closure
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind
from kiln.ir.symbolic import bounds_of, same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

_LEFT = {"aten.mm.default": 0, "aten.addmm.default": 1}  # the left operand's position
_VIEWS = {OpCategory.VIEW, OpCategory.TUPLE}
FP8_LINEAR = "kiln.fp8_linear.default"  # grouped too: dispatch/group_fp8_siblings.py


def products(region: Region) -> list[Op]:
    """The region's products (matmul ops, or block-scaled fp8 linears): one, or several
    once siblings are grouped."""
    return [o for o in region.ops
            if category(o.target) == OpCategory.MATMUL or o.target == FP8_LINEAR]


class _Sibling:
    """A GEMV region and what decides whom it may be grouped with."""

    def __init__(self, region: Region, anchor: Op, x: str, left: list[Op], weight: str, k,
                 m=None):
        self.region, self.anchor, self.x, self.left = region, anchor, x, left
        self.weight, self.m, self.k = weight, anchor.shape[0] if m is None else m, k

    def same_family(self, other: _Sibling, plan: DispatchPlan) -> bool:
        a, b = self.anchor, other.anchor
        # the same left operand: by name (a value read as it is, or ops copied into each
        # region under the same names), computed alike from the same values
        return (a.dtype == b.dtype and same_dim(self.m, other.m) and same_dim(self.k, other.k)
                and plan.values[self.weight].dtype == plan.values[other.weight].dtype
                and self.region.device == other.region.device
                and self.x == other.x and self.left == other.left
                and _inputs(self.left, self.region) == _inputs(other.left, other.region))


def _inputs(ops: list[Op], region: Region) -> list[str]:
    names = {o.name for o in ops}
    return sorted({r for o in ops for r in o.refs() if r not in names and r in region.inputs})


def _sibling(region: Region, plan: DispatchPlan) -> _Sibling | None:
    """`region` as a sibling candidate, or None when it cannot be grouped."""
    if region.kind != RegionKind.MATMUL or region.inplace or len(region.outputs) != 1:
        return None
    if region.outputs[0] in plan.state_writes.values():
        return None  # reinplace may make it write into the state: a region of its own
    mats = products(region)
    if len(mats) != 1 or mats[0].target not in _LEFT:
        return None
    anchor = mats[0]
    rows = bounds_of(anchor.shape[0], plan.symbols).hi
    if rows is None or rows > gemv_max_rows(anchor.dtype):
        return None
    ops = {o.name: o for o in region.ops}
    at = _LEFT[anchor.target]
    left_arg, right_arg = anchor.args[at], anchor.args[at + 1]
    if not (isinstance(left_arg, Ref) and isinstance(right_arg, Ref)):
        return None
    weight = _viewed_input(ops, right_arg.name, region)
    if weight is None:
        return None
    left = [o for o in region.ops if o.name in closure(ops, left_arg.name)]
    k = (ops[left_arg.name] if left_arg.name in ops else plan.values[left_arg.name]).shape[-1]
    return _Sibling(region, anchor, left_arg.name, left, weight, k)


def _viewed_input(ops: dict[str, Op], name: str, region: Region) -> str | None:
    """The region input that value `name` is a view of, through views only."""
    while name in ops:
        op = ops[name]
        if category(op.target) not in _VIEWS:
            return None
        refs = op.refs()
        if len(refs) != 1:
            return None
        name = refs[0]
    return name if name in region.inputs else None


def merged_ops(regions: list[Region]) -> list[Op] | None:
    """The regions' ops in order, each name once; None when two differ under one name."""
    out: dict[str, Op] = {}
    for r in regions:
        for o in r.ops:
            if o.name in out:
                if out[o.name] != o:
                    return None
                continue
            out[o.name] = copy.deepcopy(o)
    return list(out.values())


def _produced_before(plan: DispatchPlan, at: int) -> set[str]:
    done = {n for n, v in plan.values.items() if v.role.value in ("input", "weight", "state")}
    for r in plan.regions[:at]:
        done.update(r.outputs)
    return done


def readers_of(plan: DispatchPlan) -> dict[str, list[Region]]:
    """Value name -> the regions that read it."""
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    return readers


def returned_values(plan: DispatchPlan) -> set[str]:
    """Values that leave the plan (outputs, state writes, sends): never absorbed."""
    return set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}


def families_of(plan: DispatchPlan, sibling) -> list[list[_Sibling]]:
    """The plan's sibling candidates (`sibling(region, plan)`, None for a region that is
    not one) gathered into families of one input."""
    families: list[list[_Sibling]] = []
    for r in plan.regions:
        s = sibling(r, plan)
        if s is None:
            continue
        home = next((f for f in families if f[0].same_family(s, plan)), None)
        if home is None:
            families.append([s])
        else:
            home.append(s)
    return families


def group_siblings_of(plan: DispatchPlan) -> int:
    """Group every family of siblings that can be; returns how many regions went."""
    readers, returned = readers_of(plan), returned_values(plan)
    families = families_of(plan, _sibling)
    before = len(plan.regions)
    for family in families:
        side_by_side = _pair(plan, family, readers, returned)
        if len(side_by_side) > 1:
            group_side_by_side(plan, side_by_side)
    return before - len(plan.regions)


def _pair(plan: DispatchPlan, family: list[_Sibling], readers, returned) -> list[_Sibling]:
    """Absorb each sibling whose output only another sibling reads into that reader;
    returns the siblings left to group side by side."""
    left = list(family)
    for inner in family:
        out = inner.region.outputs[0]
        users = readers.get(out, [])
        if out in returned or len(users) != 1:
            continue
        outer = next((s for s in left if s.region is users[0] and s is not inner), None)
        if outer is None or inner not in left or not same_dim(inner.anchor.shape[1],
                                                               outer.anchor.shape[1]):
            continue
        ops = merged_ops([inner.region, outer.region])
        if ops is None:
            continue
        region = outer.region
        region.ops = ops
        region.inputs = [v for v in dict.fromkeys(inner.region.inputs + region.inputs)
                         if v != out]
        region.notes.append(f"siblings: the product of region {inner.region.name} "
                            f"(%{inner.anchor.name}, read only by this epilogue) computed "
                            "here, beside this region's own, in one GEMV")
        plan.regions.remove(inner.region)
        del plan.values[out]
        left = [s for s in left if s is not inner and s is not outer]
        log.info("paired the GEMV of %s into %s", inner.region.name, region.name)
    return left


def group_side_by_side(plan: DispatchPlan, family: list[_Sibling]) -> bool:
    """Merge independent siblings into the first one's region; False when they cannot."""
    regions = [s.region for s in family]
    outs = {o for r in regions for o in r.outputs}
    if any(set(r.inputs) & outs for r in regions):
        return False  # one reads another's output: not side by side
    at = min(plan.regions.index(r) for r in regions)
    ready = _produced_before(plan, at)
    if any(v not in ready for r in regions for v in r.inputs):
        return False
    ops = merged_ops(regions)
    if ops is None:
        return False
    first = plan.regions[at]
    first.ops = ops
    first.inputs = list(dict.fromkeys(v for r in regions for v in r.inputs))
    first.outputs = [o for r in sorted(regions, key=plan.regions.index) for o in r.outputs]
    names = [r.name for r in regions if r is not first]
    first.notes.append(f"siblings: grouped with region{'s' * (len(names) > 1)} "
                       f"{', '.join(names)} (the same input, K = {family[0].k}): "
                       f"{len(regions)} GEMVs of products "
                       f"{', '.join('%' + s.anchor.name for s in family)} in one launch")
    for r in regions:
        if r is not first:
            plan.regions.remove(r)
    log.info("grouped sibling GEMVs %s into %s", ", ".join(r.name for r in regions),
             first.name)
    return True


@as_pass
def group_siblings(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        group_siblings_of(plan)
    return plan
