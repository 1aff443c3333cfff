"""Fold a pointwise region into the one-token fp8 linear that alone reads it as x: one
kernel fewer per such region.

The fp16 decode layer's SwiGLU is the gate/up GEMV's epilogue (each program holds its
gate and up columns); the fp8 gate/up product (kiln::fp8_linear) has no such epilogue,
so in fp8 the SwiGLU between w13 and w2 was a pointwise kernel of its own (~2 us and a
graph gap a layer, one more dependent stage of the step). The fp8 GEMV quantises x
per 128-element block in every program anyway, reading x through the emitter
(templates/fp8_matmul/gemv.py), so it computes `silu(g) * u` where it reads x as
cheaply as it reads x: the pointwise region's ops become the fp8 region's prologue.

A region folds when it is pointwise, writes nothing in place, its one output leaves
through no plan output and is read by one region only: a kiln::fp8_linear of at most
FP8_GEMV_MAX_M tokens (its GEMV form; the swap and tiled forms' programs would each
recompute the prologue over many rows) that reads it only as x through reshapes. Runs
after group_fp8_siblings, which pairs separate gate and up linears into their SiLU
product's region: only what no pair took (a fused w13's SwiGLU) folds here. Only
targets that generate kernels fold. A template that declines the prologue gets it split
out again (codegen/select_kernels.py, dispatch/split.py).
"""

from __future__ import annotations

import logging

from kiln.dispatch.fold_rmsnorm import FP8_GEMV_MAX_M, FP8_LINEAR
from kiln.dispatch.prologue_copy import copy_prologue
from kiln.dispatch.rmsnorm_prologue import read_only_as_operand
from kiln.ir.plan import DispatchPlan, Region, RegionKind
from kiln.ir.symbolic import bounds_of, numel
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")


def _one_token_fp8(reader: Region, value: str, plan: DispatchPlan) -> bool:
    """Does `reader` compute a one-token fp8 linear reading `value` only as its x?"""
    if reader.kind != RegionKind.EXTERN:
        return False
    anchor = reader.anchor()
    if anchor.target != FP8_LINEAR or not read_only_as_operand(
            reader.ops, reader.outputs, anchor, 0, value):
        return False
    x = anchor.args[0]
    shape = reader.op(x.name).shape if x.name != value else plan.values[x.name].shape
    rows = bounds_of(numel(shape[:-1]), plan.symbols).hi
    return rows is not None and rows <= FP8_GEMV_MAX_M


def fold_fp8_prologues(plan: DispatchPlan) -> int:
    """Fold every pointwise region that can be; returns how many were."""
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    kept = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    folded = 0
    for region in list(plan.regions):
        if region.kind != RegionKind.POINTWISE or region.inplace or len(region.outputs) != 1:
            continue
        out = region.outputs[0]
        users = readers.get(out, [])
        if out in kept or len(users) != 1 or users[0].device != region.device \
                or not _one_token_fp8(users[0], out, plan):
            continue
        copy_prologue(users[0], region, region.ops,
                      f"prologue: region {region.name} (%{out}) computed where the fp8 "
                      "GEMV reads its x")
        for v in region.inputs:
            readers.setdefault(v, []).append(users[0])
        plan.regions.remove(region)
        del plan.values[out]
        folded += 1
        log.info("folded %s (%%%s) into the fp8 linear %s", region.name, out, users[0].name)
    return folded


@as_pass
def fold_fp8_prologue(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_fp8_prologues(plan)
    return plan
