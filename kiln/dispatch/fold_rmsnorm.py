"""Fold an RMSNorm or LayerNorm into the decode matmuls that read it: one kernel fewer
per norm.

At decode a Llama layer's two RMSNorms are kernels of ~2 us each (plus the gap
between graph nodes) over 8 KB rows, while the GEMV after each reads all of x's row
anyway. The norm is a row scale (kiln.dispatch.rmsnorm_prologue): y @ W = r * ((x *
w) @ W) per row, r = rsqrt(mean(x^2) + eps), so the matmul template's GEMV form sums
x^2 beside the product and scales each row's accumulator before its epilogue. A
LayerNorm (GPT-2, GPT-NeoX, StableLM, Starcoder2, Phi-2, ...) of up to
LAYER_NORM_MAX_K elements folds too; the GEMV takes each row's mean and rstd before its
K loop (kiln.dispatch.layernorm_prologue says why).

A norm region folds when it computes only the norm (pointwise ops around one mean or
one native_layer_norm),
its value leaves through no output, and every region that reads it is a matmul (mm,
addmm) that reads it only as its left operand through reshapes, with at most
gemv_max_rows(dtype) rows (the GEMV form's). Each such matmul gets a copy of the
norm's ops and reads the norm's inputs instead; the norm region goes. Several readers (HF
Llama's separate q, k, v projections) each recompute it: x is a few KB. A one-token
fp8 linear (kiln::fp8_linear, its GEMV form) folds an RMSNorm the same way when it is the norm's
only reader (several fp8 readers are siblings that group_fp8_siblings gives one launch
reading x once). A norm any other region reads, a tiled (prefill) matmul, or a region
that is not a plain norm stays as it is. Only targets that generate kernels fold: the
CPU target runs torch ops, where a norm computed three times is three times the work.
"""

from __future__ import annotations

import logging

from kiln.dispatch.layernorm_prologue import (
    LAYER_NORM_MAX_K,
    LayerNormRows,
    match_layer_norm,
)
from kiln.dispatch.prologue_copy import copy_prologue
from kiln.dispatch.rmsnorm_prologue import closure, match_row_norm, read_only_as_operand
from kiln.ir.ops import IDENTITY_OPS, OpCategory, category
from kiln.ir.plan import DispatchPlan, Region, RegionKind
from kiln.ir.symbolic import bounds_of, numel, same_dim
from kiln.pipeline import as_pass
from kiln.target import gemv_max_rows

log = logging.getLogger("kiln.dispatch")

# tokens the fp8 linear takes its CUDA-core GEMV form for (codegen/.../fp8_matmul/gemv.py):
# the fold below and group_fp8_siblings read it
FP8_GEMV_MAX_M = 1
_LEFT = {"aten.mm.default": 0, "aten.addmm.default": 1}  # the left operand's position
FP8_LINEAR = "kiln.fp8_linear.default"
_INLINE = {OpCategory.POINTWISE, OpCategory.VIEW, OpCategory.CREATE, OpCategory.TUPLE}


def _plain_norm(region: Region):
    """The region's RowNorm when it computes nothing but the norm of its output."""
    if region.kind != RegionKind.REDUCTION or len(region.outputs) != 1:
        return None
    ops = {o.name: o for o in region.ops}
    norm = match_row_norm(ops, region.outputs[0]) or match_layer_norm(ops, region.outputs[0])
    if norm is None:
        return None
    stat = norm.op if isinstance(norm, LayerNormRows) else norm.mean
    others = [o for o in region.ops if o.name != stat and o.target not in IDENTITY_OPS
              and category(o.target) not in _INLINE]
    return None if others else norm


def _folds_into(reader: Region, norm, plan: DispatchPlan) -> bool:
    """May `reader` compute the norm `norm` as its prologue?"""
    if reader.kind == RegionKind.EXTERN:
        return _folds_into_fp8(reader, norm, plan)
    if reader.kind != RegionKind.MATMUL:
        return False
    anchor = reader.anchor()
    arg = _LEFT.get(anchor.target)
    if arg is None or not read_only_as_operand(reader.ops, reader.outputs, anchor, arg,
                                               norm.out):
        return False
    if isinstance(norm, LayerNormRows) and not (isinstance(norm.dim, int)
                                                and norm.dim <= LAYER_NORM_MAX_K):
        return False  # the GEMV loads each row whole first (layernorm_prologue)
    a = anchor.args[arg]
    k = (reader.op(a.name).shape if a.name != norm.out else plan.values[a.name].shape)[-1]
    rows = bounds_of(anchor.shape[0], plan.symbols).hi
    return (same_dim(k, norm.dim) and rows is not None
            and rows <= gemv_max_rows(anchor.dtype))


def _folds_into_fp8(reader: Region, norm, plan: DispatchPlan) -> bool:
    """An fp8 linear (kiln::fp8_linear) of one token reading the norm as its x: its GEMV
    form quantises x * w and scales by the norm's row factor after the product
    (templates/fp8_matmul/folded_norm.py)."""
    anchor = reader.anchor()
    if isinstance(norm, LayerNormRows):
        return False  # templates/fp8_matmul/folded_norm.py scales rows: RMSNorm only
    if anchor.target != FP8_LINEAR or not read_only_as_operand(
            reader.ops, reader.outputs, anchor, 0, norm.out):
        return False
    x = anchor.args[0]
    shape = reader.op(x.name).shape if x.name != norm.out else plan.values[x.name].shape
    rows = bounds_of(numel(shape[:-1]), plan.symbols).hi
    return same_dim(shape[-1], norm.dim) and rows is not None and rows <= FP8_GEMV_MAX_M


def fold_norms(plan: DispatchPlan) -> int:
    """Fold every norm region that can be; returns how many were."""
    readers: dict[str, list[Region]] = {}
    for r in plan.regions:
        for v in r.inputs:
            readers.setdefault(v, []).append(r)
    returned = set(plan.outputs) | set(plan.state_writes.values()) | {v for v, _ in plan.send}
    folded = 0
    for region in list(plan.regions):
        norm = _plain_norm(region)
        if norm is None or norm.out in returned:
            continue
        users = readers.get(norm.out, [])
        if not users or not all(_folds_into(u, norm, plan) for u in users):
            continue
        if len(users) > 1 and any(u.kind == RegionKind.EXTERN for u in users):
            continue  # fp8 siblings (q, k, v apart): group_fp8_siblings reads x once
        inside = closure({o.name: o for o in region.ops}, norm.out)
        for u in users:
            copy_prologue(u, region, [o for o in region.ops if o.name in inside],
                          f"prologue: the {_kind(norm)} of region {region.name} (%{norm.out}) "
                          f"folded in: {_how(norm)}")
        plan.regions.remove(region)
        del plan.values[norm.out]
        folded += 1
        log.info("folded the %s %s (%%%s) into %s", _kind(norm), region.name, norm.out,
                 ", ".join(u.name for u in users))
    return folded


def _kind(norm) -> str:
    return "LayerNorm" if isinstance(norm, LayerNormRows) else "RMSNorm"


def _how(norm) -> str:
    if isinstance(norm, LayerNormRows):
        return "each row's mean and rstd taken first, x normalised as the weight streams"
    return "each row's rsqrt(mean(x^2) + eps) scales the product"


@as_pass
def fold_rmsnorm(plan: DispatchPlan, ctx) -> DispatchPlan:
    if ctx.target.uses_triton:
        fold_norms(plan)
    return plan
