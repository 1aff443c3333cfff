"""Split a fused region whose kernel cannot fit the target (DESIGN.md, failure 1).

Fusion is a choice, not a requirement: RoPE fused into attention saves a round trip
through memory, but if every config of the fused kernel needs more shared memory
than the target has, the fused region must come apart rather than fail. This file
does the plan surgery; codegen decides when (it knows the resource figures).

`split_prologue(plan, region, operand, why)` takes the ops that compute one operand
of the region's anchor (the RoPE of the query, a mask built from arange) and moves
them into a new pointwise region placed just before it (a reduction region when
they hold an RMSNorm that fold_rmsnorm put there). The operand becomes a plan
value (contiguous, memory-planned); the anchor region keeps only the views between
that value and the anchor, so its template reads it like any input. Both regions
get a note saying what was split and why.

`split_epilogue(plan, region, why)` does the converse for a template that can run the
anchor but not the ops after it (a tiled matmul whose epilogue reads the product at
other columns than the tile's): the anchor, with the views feeding it, becomes a
region of its own whose output is the product, and the region keeps the epilogue as
a pointwise region reading it.

`split_group_epilogue(plan, region, output, why)` is split_epilogue for grouped sibling
GEMVs: one sibling's epilogue (q's rotate_half RoPE beside k and v) comes out as a
pointwise region after the group, which keeps its products in one launch.

`split_siblings(plan, region, why)` undoes dispatch/group_siblings.py and
group_fp8_siblings.py: a region holding several products (sibling GEMVs) becomes one
region per product again, each with its own copy of the ops its product reads (the
shared input, an RMSNorm folded in), when the template declines the group or the
separate kernels are timed faster.

Assumes a verified plan (every region's ops in dependency order, refs defined);
establishes the same, with the new region's output produced before it is read.
"""

from __future__ import annotations

import copy
import logging

from kiln.dispatch.group_siblings import products
from kiln.ir.ops import OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, TensorValue

log = logging.getLogger("kiln.dispatch")

_NO_COMPUTE = {OpCategory.VIEW, OpCategory.CREATE, OpCategory.TUPLE}


def _is_compute(op: Op) -> bool:
    c = category(op.target)
    if c == OpCategory.TUPLE or op.target == "getitem":
        return False
    return c not in _NO_COMPUTE


def _closure(region: Region, roots: list[str], stop: set[str]) -> list[Op]:
    """The ops of `region` needed for `roots`, not looking past `stop` or region inputs."""
    by_name = {o.name: o for o in region.ops}
    needed: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in needed or name in stop or name not in by_name:
            continue
        needed.add(name)
        stack.extend(by_name[name].refs())
    return [o for o in region.ops if o.name in needed]


def materialisation_point(region: Region, operand: Ref) -> Op | None:
    """The last compute op on the way to `operand` (what a split would materialise).

    Walks back through views from the anchor's argument; None when the operand is
    only a view of region inputs (nothing to split off).
    """
    if not isinstance(operand, Ref) or operand.name in region.inputs:
        return None
    op = region.op(operand.name)
    while not _is_compute(op):
        through = category(op.target) == OpCategory.VIEW or op.target == "getitem"
        srcs = [r for r in op.refs() if r not in region.inputs]
        if not through or not srcs:
            return None
        op = region.op(srcs[0])
    return op


def splittable_operands(region: Region) -> list[str]:
    """Names of the anchor's tensor arguments that carry prologue compute."""
    anchor = region.anchor()
    out = []
    for a in list(anchor.args) + list(anchor.kwargs.values()):
        if isinstance(a, Ref) and materialisation_point(region, a) is not None \
                and a.name not in out:
            out.append(a.name)
    return out


def split_prologue(plan: DispatchPlan, region: Region, operand: str, why: str) -> Region | None:
    """Move the compute behind the anchor argument `operand` into a new region before
    `region`; returns the new region (None if that argument has no prologue)."""
    point = materialisation_point(region, Ref(operand))
    if point is None or point.shape is None:
        return None
    moved = [copy.deepcopy(o) for o in _closure(region, [point.name], set())]
    inputs = _inputs_of(moved, region.inputs)
    cats = {category(o.target) for o in moved}
    # a folded RMSNorm (dispatch/fold_rmsnorm.py) comes back out as the reduction it was
    kind = (RegionKind.REDUCTION if OpCategory.REDUCTION in cats else
            RegionKind.POINTWISE if OpCategory.POINTWISE in cats else RegionKind.COPY)
    role = operand_role(region.anchor(), operand)
    new = Region(_fresh_name(plan, f"{region.name}_{role}"), kind, moved, inputs,
                 [point.name], device=region.device)
    plan.values[point.name] = TensorValue(point.name, tuple(point.shape), point.dtype,
                                          Role.TEMP)
    kept = _closure(region, list(region.outputs), {point.name})
    region.ops = kept
    # the mask envelope's values stay: the kernel reads them, not an op (mask_envelope.py)
    region.inputs = _inputs_of(kept, region.inputs + [point.name]) + \
        [b for b in region.key_bound_values() if b in region.inputs]
    n_compute = sum(_is_compute(o) for o in moved)
    region.notes.append(f"split: the {role}'s prologue ({n_compute} ops computing "
                        f"%{point.name}) moved to region {new.name}: {why}")
    new.notes.append(f"split from region {region.name} (the {role}'s prologue): {why}")
    plan.regions.insert(plan.regions.index(region), new)
    log.info("split region %s: %%%s now comes from %s (%s)", region.name, point.name,
             new.name, why)
    return new


def split_epilogue(plan: DispatchPlan, region: Region, why: str) -> Region:
    """Move the anchor of `region` into a new region before it, the product its output;
    `region` keeps the epilogue. Returns the new region."""
    anchor = region.anchor()
    moved = [copy.deepcopy(o) for o in _closure(region, [anchor.name], set())]
    new = Region(_fresh_name(plan, f"{region.name}_product"), region.kind, moved,
                 _inputs_of(moved, region.inputs), [anchor.name], device=region.device,
                 label=region.label)
    plan.values[anchor.name] = TensorValue(anchor.name, tuple(anchor.shape), anchor.dtype,
                                           Role.TEMP)
    kept = _closure(region, list(region.outputs), {anchor.name})
    region.ops = kept
    region.inputs = _inputs_of(kept, region.inputs + [anchor.name])
    region.kind = (RegionKind.POINTWISE if any(category(o.target) == OpCategory.POINTWISE
                                               for o in kept) else RegionKind.COPY)
    region.label = None
    n_compute = sum(_is_compute(o) for o in kept)
    region.notes.append(f"split: the product %{anchor.name} moved to region {new.name}; "
                        f"this region keeps its epilogue ({n_compute} ops): {why}")
    new.notes.append(f"split from region {region.name} (its epilogue stays there): {why}")
    plan.regions.insert(plan.regions.index(region), new)
    log.info("split region %s: its product %%%s now comes from %s (%s)", region.name,
             anchor.name, new.name, why)
    return new


def has_epilogue(region: Region) -> bool:
    """Does `region` compute anything after its anchor (ops past the product that are not
    views)? split_epilogue then leaves a kernel's worth of work on each side."""
    feeding = {o.name for o in _closure(region, [region.anchor().name], set())}
    return any(_is_compute(o) for o in region.ops if o.name not in feeding)


def epilogue_outputs(region: Region) -> list[str]:
    """The outputs of a grouped region (several products) computed past their products:
    what split_group_epilogue can take out, in output order."""
    names = {m.name for m in products(region)}
    return [o for o in region.outputs if o not in names
            and any(_is_compute(op) for op in _closure(region, [o], names))]


def split_group_epilogue(plan: DispatchPlan, region: Region, output: str, why: str) -> Region:
    """Move the ops computing `output` past the products it reads into a new pointwise
    region after `region`; the products become outputs of `region` (plan values), the
    group keeps every product. Returns the new region."""
    mats = products(region)
    names = {m.name for m in mats}
    moved = [copy.deepcopy(o) for o in _closure(region, [output], names)]
    read = [m.name for m in mats if any(m.name in o.refs() for o in moved)]
    for m in mats:
        if m.name in read and m.name not in plan.values:
            plan.values[m.name] = TensorValue(m.name, tuple(m.shape), m.dtype, Role.TEMP)
    kind = (RegionKind.POINTWISE if any(category(o.target) == OpCategory.POINTWISE
                                        for o in moved) else RegionKind.COPY)
    new = Region(_fresh_name(plan, f"{region.name}_epilogue"), kind, moved,
                 _inputs_of(moved, region.inputs + read), [output], device=region.device)
    outputs = []
    for o in region.outputs:
        for n in (read if o == output else [o]):
            if n not in outputs:
                outputs.append(n)
    region.outputs = outputs
    region.ops = _closure(region, outputs, set())
    region.inputs = _inputs_of(region.ops, region.inputs)
    n_compute = sum(_is_compute(o) for o in moved)
    region.notes.append(f"split: the epilogue of %{output} ({n_compute} ops) moved to region "
                        f"{new.name}; the siblings stay grouped: {why}")
    new.notes.append(f"split from region {region.name} (its grouped products stay there): "
                     f"{why}")
    plan.regions.insert(plan.regions.index(region) + 1, new)
    log.info("split region %s: the epilogue of %%%s now runs in %s (%s)", region.name,
             output, new.name, why)
    return new


def split_siblings(plan: DispatchPlan, region: Region, why: str) -> list[Region]:
    """One region per product of `region` (in order, `region` itself the last); a
    product another one's epilogue read becomes a plan value again. Paired fp8
    products (dispatch/group_fp8_siblings.py) also give their pointwise ops back to a
    region of their own (the fp8 linear's kernel has no epilogue). Returns them."""
    mats = products(region)
    out_of = {}  # output -> the products it reads
    for o in region.outputs:
        inside = {op.name for op in _closure(region, [o], set())}
        out_of[o] = [m for m in mats if m.name in inside]
    parts: list[tuple[list[str], set[str]]] = []  # (outputs, values the part stops at)
    for o in region.outputs:
        first, *rest = out_of[o]
        for m in rest:  # an absorbed product (SwiGLU's up) comes out as a value of its own
            parts.append(([m.name], set()))
            plan.values[m.name] = TensorValue(m.name, tuple(m.shape), m.dtype, Role.TEMP)
        parts.append(([o], {m.name for m in rest}))
    made = []
    for outs, stop in parts[:-1]:
        ops = [copy.deepcopy(op) for op in _closure(region, outs, stop)]
        made.append(Region(_fresh_name(plan, f"{region.name}_sibling"), region.kind, ops,
                           _inputs_of(ops, region.inputs), outs, device=region.device,
                           label=region.label))
        plan.regions.insert(plan.regions.index(region), made[-1])
    outs, stop = parts[-1]
    region.ops = _closure(region, outs, stop)
    region.inputs = _inputs_of(region.ops, region.inputs + [n for o, _ in parts[:-1] for n in o])
    region.outputs = outs
    for r in made + [region]:
        r.notes.append(f"siblings apart: {why}")
    if region.kind == RegionKind.EXTERN and region.outputs != [region.anchor().name]:
        made.append(split_epilogue(plan, region, f"siblings apart: {why}"))
    log.info("split the siblings of region %s apart (%s)", region.name, why)
    return made + [region]


def operand_role(anchor: Op, operand: str) -> str:
    """The schema name of the anchor argument `operand` ('query', 'key', 'attn_mask')."""
    try:
        bound = bind_args(anchor)
    except (AttributeError, ValueError):  # no ATen schema: positions stand in for names
        bound = {**{f"arg{i}": a for i, a in enumerate(anchor.args)}, **anchor.kwargs}
    for k, v in bound.items():
        if v == Ref(operand):
            return k
    return operand


def _inputs_of(ops: list[Op], candidates: list[str]) -> list[str]:
    used = {r for o in ops for r in o.refs()}
    return [v for v in dict.fromkeys(candidates) if v in used]


def _fresh_name(plan: DispatchPlan, base: str) -> str:
    names = {r.name for r in plan.regions}
    name, i = base, 1
    while name in names:
        i += 1
        name = f"{base}{i}"
    return name
