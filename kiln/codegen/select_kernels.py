"""Choose a kernel for every region of the plan, for the compile's target.

On the CPU every region runs as PyTorch ops (TorchKernel): the same plan, memory
planning and scheduling as on a GPU, so the whole pipeline is testable anywhere.
For Triton targets TEMPLATES below says which template turns each region kind into a
KernelSpec; build.resources keeps only configs that fit the target (splitting the
region when none can), and the autotuner picks one that compiles. A region whose
template declines (it raises CodegenUnsupported, saying why), or whose every config
fails, runs as its extern form (torch ops on the device: cuBLAS, SDPA), and the
region's note says why; a template that can run the anchor but not its epilogue
(EpilogueApart) gets the region split in two instead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from copy import deepcopy

from kiln.codegen.autotune.tuner import choose, precompile, will_time
from kiln.codegen.autotune.worker_pool import stop_run_worker
from kiln.codegen.build.resources import fitted_spec
from kiln.codegen.build.spec import KernelSpec
from kiln.codegen.expr.values import CodegenUnsupported, EpilogueApart
from kiln.codegen.kernel_plan import KernelPlan
from kiln.codegen.templates import copy, grouped_mm, pointwise, topk
from kiln.codegen.templates.attention import template as attention
from kiln.codegen.templates.fp8_matmul import gemm as fp8_gemm
from kiln.codegen.templates.fp8_matmul import grouped as fp8_grouped
from kiln.codegen.templates.fp8_matmul import quantize as fp8_quantize
from kiln.codegen.templates.fp8_matmul import template as fp8_matmul
from kiln.codegen.templates.gated_delta import template as gated_delta
from kiln.codegen.templates.latent_attention import template as latent_attention
from kiln.codegen.templates.matmul import grouped as matmul
from kiln.codegen.templates.moe import template as moe
from kiln.codegen.templates.reduction import row_kernel as reduction
from kiln.codegen.torch_kernel import TorchKernel
from kiln.dispatch.fold_cache_writes import unfold_cache_writes
from kiln.dispatch.group_siblings import products
from kiln.dispatch.split import (
    epilogue_outputs,
    has_epilogue,
    split_epilogue,
    split_group_epilogue,
    split_prologue,
    split_siblings,
    splittable_operands,
)
from kiln.ir.ops import OpCategory, category, is_fallback
from kiln.ir.plan import DispatchPlan, Region, RegionKind
from kiln.pipeline import as_pass
from kiln.progress import phase
from kiln.target import Target

log = logging.getLogger("kiln.codegen")

Template = Callable[[Region, DispatchPlan, Target], KernelSpec]

# Which template generates each region kind. EXTERN regions (ops kiln does not
# generate) have none: they run as torch ops, unless EXTERN_TEMPLATES has their op.
TEMPLATES: dict[RegionKind, Template] = {
    RegionKind.POINTWISE: pointwise.generate_pointwise,
    RegionKind.REDUCTION: reduction.generate_reduction,
    RegionKind.MATMUL: matmul.generate,
    RegionKind.ATTENTION: attention.generate,
    RegionKind.COPY: copy.generate_copy,
    RegionKind.TOPK: topk.generate,
}

# Extern ops kiln has a hand-written template for, by the region's extern (anchor) op:
# kept whole through export (a recurrence no fusion could rebuild), generated here.
EXTERN_TEMPLATES: dict[str, Template] = {
    gated_delta.OP: gated_delta.generate,
    latent_attention.OP: latent_attention.generate,
    fp8_matmul.OP: fp8_grouped.generate,  # one fp8 linear, or grouped siblings
    moe.OP: moe.generate,
    moe.FP8_OP: moe.generate,
    fp8_quantize.QUANTIZE_OP: fp8_quantize.generate,
    fp8_gemm.SCALED_MM_OP: fp8_gemm.generate,
    **{op: grouped_mm.generate for op in grouped_mm.OPS},
}


def template_for(region: Region) -> Template | None:
    if region.kind == RegionKind.EXTERN:
        return EXTERN_TEMPLATES.get(region.anchor().target)
    return TEMPLATES.get(region.kind)


def kernel_for(region: Region, plan: DispatchPlan, target: Target, ctx):
    """The region's kernel on a Triton target: its template's, tuned, or torch ops."""
    got = spec_for(region, plan, target)
    return choose(region, got, target, ctx, plan) if isinstance(got, KernelSpec) else got


def spec_for(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec | TorchKernel:
    """The region's kernel spec on a Triton target (configs that fit it), or torch ops."""
    template = template_for(region)
    if template is None:
        region.notes.append(f"extern: kiln generates no kernel for {region.kind.value} "
                            "regions")
        return TorchKernel(region, target.torch_device)
    try:
        # Only configs that can fit the target; may split the region (new regions in plan).
        with phase("templates"):
            spec = fitted_spec(region, plan, target, template)
    except EpilogueApart as e:
        # The product gets a kernel of its own (select_kernels' loop reaches the new
        # region); this region, now its epilogue alone, is chosen for again.
        split_epilogue(plan, region, str(e))
        return spec_for(region, plan, target)
    except CodegenUnsupported as e:
        if len(products(region)) > 1:
            # grouped sibling GEMVs (dispatch/group_siblings.py, group_fp8_siblings.py)
            # the template cannot run: first a sibling's epilogue comes out (q's
            # rotate_half RoPE beside k and v: one GEMV launch and a pointwise kernel,
            # not three GEMVs), then the siblings apart, each its kernel alone (the new
            # regions are reached by select_kernels' loop; this one is chosen for again)
            apart = epilogue_outputs(region)
            if apart and region.kind == RegionKind.MATMUL:
                split_group_epilogue(plan, region, apart[0],
                                     f"the grouped GEMV declines its epilogue: {e}")
            else:
                split_siblings(plan, region, f"the grouped GEMV declines: {e}")
            return spec_for(region, plan, target)
        if region.kind == RegionKind.ATTENTION and unfold_cache_writes(
                plan, region, f"the template declines: {e}"):
            # cache writes folded in (dispatch/fold_cache_writes): back to their copy
            # region before the attention (select_kernels' loop reaches it)
            return spec_for(region, plan, target)
        if region.kind == RegionKind.ATTENTION and _reduces(region):
            # a query norm's sum folded in (dispatch/fold_query_norm): the query's
            # prologue runs apart, as before the fold, the attention keeps its kernel
            query = region.anchor().args[0].name
            moved = split_prologue(plan, region, query, f"the template declines: {e}")
            if moved is not None and not _reduces(region):
                return spec_for(region, plan, target)
        operands = splittable_operands(region) if region.kind == RegionKind.EXTERN else []
        if operands:
            # producers dispatch folded into a kernel op's region (fold_delta_step)
            # that its template cannot compute: they run apart, the op keeps its kernel
            for operand in operands:
                split_prologue(plan, region, operand, f"the template declines: {e}")
            return spec_for(region, plan, target)
        if region.kind == RegionKind.MATMUL and has_epilogue(region):
            # an epilogue the template cannot compute (RoPE's rotate_half reads the
            # product half a head left and right): the product keeps its kernel (and a
            # folded norm), the epilogue runs as a kernel after it, not both as torch ops
            split_epilogue(plan, region, f"the matmul template declines the region ({e}): "
                           "its epilogue runs as a kernel of its own")
            return spec_for(region, plan, target)
        region.notes.append(f"extern: the {region.kind.value} template declines: {e}")
        log.info("region %s: %s template declines: %s", region.name, region.kind.value, e)
        return TorchKernel(region, target.torch_device)
    if spec is None:  # nothing fits even split; fitted_spec noted why
        return TorchKernel(region, target.torch_device)
    return spec


def _reduces(region: Region) -> bool:
    return any(category(o.target) == OpCategory.REDUCTION for o in region.ops)


def _complex_values(region: Region, plan: DispatchPlan) -> list[str]:
    """Values of a complex dtype the region reads or makes (an FFT's, view_as_complex's)."""
    dtypes = [(v, plan.values[v].dtype) for v in region.inputs]
    dtypes += [(op.name, op.dtype) for op in region.ops]
    return [v for v, d in dtypes if d is not None and d.is_complex]


@as_pass
def select_kernels(plan: DispatchPlan, ctx) -> KernelPlan:
    target = ctx.target
    kp = KernelPlan(plan, target)
    pending = list(plan.regions)
    try:
        _select(plan, ctx, kp, pending)
    finally:  # its CUDA context would hold GPU memory the compiled model may want
        stop_run_worker()
    return kp


def _select(plan: DispatchPlan, ctx, kp: KernelPlan, pending: list[Region]) -> None:
    """Every region's spec first (templates; splits add regions), then every candidate
    the tuner will need compiled at once (the pool's workers busy across kernels, not
    one kernel's few configs at a time), then each region's choice, in plan order."""
    target = ctx.target
    queue = deque(pending)
    queued = {r.name for r in pending}
    chosen: dict[str, object] = {}  # region name -> its kernel, or its spec to tune
    while queue:
        region = queue.popleft()
        fallen = sorted({op.target for op in region.ops if is_fallback(op.target)})
        if fallen:
            region.notes.append(f"fallback: kiln has no kernel for {', '.join(fallen)}; "
                                "runs as PyTorch's own op")
        complex_ = _complex_values(region, plan)
        if complex_ and target.uses_triton:
            region.notes.append(f"extern: Triton has no complex dtypes (%{complex_[0]})")
        regions_before = len(plan.regions)
        if target.uses_triton and not (fallen or complex_):
            chosen[region.name] = spec_for(region, plan, target)
        else:
            chosen[region.name] = TorchKernel(region, target.torch_device)
        if len(plan.regions) != regions_before:
            # A split inserts regions before the one it split: they need kernels too.
            # (By name: comparing Regions compares every op, cubic in the region count.)
            new = [r for r in plan.regions if r.name not in chosen and r.name not in queued]
            queue.extend(new)
            queued.update(r.name for r in new)
    regions = {r.name: r for r in plan.regions}
    specs = [(regions[n], s) for n, s in chosen.items() if isinstance(s, KernelSpec)]
    built = specs + (_apart_specs(plan, specs, target) if will_time(target, ctx) else [])
    tuner = precompile(built, target, ctx, plan) if specs else None
    try:
        for name, got in chosen.items():
            kp.kernels[name] = choose(regions[name], got, target, ctx, plan, tuner) \
                if isinstance(got, KernelSpec) else got
            if tuner is not None and len(products(regions[name])) > 1:
                _siblings_apart_if_faster(plan, regions[name], ctx, kp, tuner)
    finally:
        if tuner is not None:  # a background build (KILN_TUNE_OVERLAP) ends with the plan
            tuner.finish()


def _apart_specs(plan: DispatchPlan, specs: list[tuple[Region, KernelSpec]],
                 target: Target) -> list[tuple[Region, KernelSpec]]:
    """The specs each distinct grouped kernel's siblings run as apart, which
    _siblings_apart_if_faster times after the group: compiled in the plan's one pool run
    with the rest. Why: compiled when each group's turn came, one group's few configs at
    a time while the other workers idled, they were most of the 4.2-4.8 s an 8B LLM's
    narrow version waited on builds (H200). The plan is left as it was."""
    out, seen = [], set()
    for region, spec in specs:
        if len(products(region)) < 2 or spec.source_hash in seen:
            continue
        seen.add(spec.source_hash)
        saved, regions, values = deepcopy(region), list(plan.regions), dict(plan.values)
        try:
            for r in split_siblings(plan, region, "its siblings' kernels built ahead"):
                got = spec_for(r, plan, target)
                if isinstance(got, KernelSpec):
                    out.append((r, got))
        finally:
            _restore(plan, region, saved, regions, values)
    return out


def _restore(plan: DispatchPlan, region: Region, saved: Region, regions: list[Region],
             values: dict) -> None:
    """Undo a split of `region` (saved: its deep copy; regions, values: the plan's)."""
    region.__dict__.update(saved.__dict__)
    plan.regions[:] = regions
    plan.values.clear()
    plan.values.update(values)


def _siblings_apart_if_faster(plan: DispatchPlan, region: Region, ctx, kp: KernelPlan,
                              tuner) -> None:
    """Grouped sibling GEMVs (dispatch/group_siblings.py, group_fp8_siblings.py: then
    with the pointwise region they were paired into) stay grouped only if their
    kernel, timed, beats the siblings' own choices (each its GEMV or cuBLAS) summed; an
    untimed compile keeps the group: it runs the plain GEMV's loop in one launch
    instead of several. The plan is restored when the group wins."""
    grouped = tuner.times.pop(region.name, None)
    if grouped is None:
        return
    saved, regions, values = deepcopy(region), list(plan.regions), dict(plan.values)
    parts = split_siblings(plan, region, "timing the siblings apart")
    kernels, apart = {}, 0.0
    for r in parts:
        got = spec_for(r, plan, ctx.target)
        kernels[r.name] = choose(r, got, ctx.target, ctx, plan, tuner) \
            if isinstance(got, KernelSpec) else got
        ms = tuner.times.pop(r.name, None)
        if ms is None:
            apart = None
            break
        apart += ms
    if apart is not None and apart < grouped:
        for r in parts:
            r.notes.append(f"siblings apart: {apart:.4f} ms in {len(parts)} kernels against "
                           f"{grouped:.4f} ms grouped")
        del kp.kernels[region.name]
        kp.kernels.update(kernels)
        return
    tuner.times[region.name] = grouped
    _restore(plan, region, saved, regions, values)
    region.notes.append(f"siblings kept grouped: {grouped:.4f} ms against "
                        + (f"{apart:.4f} ms apart" if apart is not None else "untimed apart"))
