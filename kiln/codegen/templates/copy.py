"""Copy regions: scatters into state in place, and gather / concat-only regions.

A scatter region whose output is written in place (`Region.inplace`: the output IS the
state tensor, e.g. the KV cache) walks the *update* (the rows being written), computes
each element of the values through the emitter, so a pointwise prologue (RoPE of k)
fuses, and stores it at its destination: only the scattered rows are touched. Covered:
index_put (None and tensor indices; accumulate via atomics), index_copy, index_add,
scatter / scatter_add, slice_scatter and select_scatter. A functional slice/select
scatter is per-element selection (the pointwise kernel); a functional index scatter
would have to copy the whole destination first, so it runs extern.
Regions without a scatter (embedding lookups, rope-table gathers, cat, returned views)
are pointwise kernels over their output (row kernels if they recompute a reduction).
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source, needs_int64
from kiln.codegen.expr.gather import _index_value, advanced_index, indexed_shape
from kiln.codegen.expr.indexing import Lin, Var, broadcast_index, delinearize
from kiln.codegen.expr.kernel_args import KernelArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, mask_of
from kiln.codegen.expr.views import select_index, slice_bounds
from kiln.codegen.templates.pointwise import pointwise_configs, pointwise_spec
from kiln.codegen.templates.reduction.row_kernel import RowKernel
from kiln.ir.ops import SLICE_SCATTERS, OpCategory, bind_args, category, norm_axis
from kiln.ir.plan import DispatchPlan, Op, Ref, Region
from kiln.ir.symbolic import numel, same_dim, to_str, upper_bound
from kiln.target import Target

ATOMIC_DTYPES = {torch.float32, torch.int32}


def generate_copy(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The copy region's kernel; raises CodegenUnsupported saying why it declines."""
    scatters = [op for op in region.ops if category(op.target) == OpCategory.SCATTER]
    if not scatters:
        if any(category(op.target) == OpCategory.REDUCTION for op in region.ops):
            # a returned duplicate of a reduction's value is recomputed in a copy region
            return RowKernel(region, plan, target).spec()
        return pointwise_spec(region, plan, target, kind="copy")
    if region.outputs != [op.name for op in scatters]:
        raise CodegenUnsupported("a copy region whose outputs are not its scatters")
    if len(scatters) > 1:  # cache writes side by side (dispatch/group_cache_writes.py)
        if any(op.name not in region.inplace for op in scatters):
            raise CodegenUnsupported("several scatters, not all written in place")
        return scatter_spec(region, plan, target, *scatters)
    op = scatters[0]
    if op.name not in region.inplace:
        if op.target in SLICE_SCATTERS:
            return pointwise_spec(region, plan, target, kind="copy")
        raise CodegenUnsupported(f"functional {op.target} (not written in place)")
    return scatter_spec(region, plan, target, op)


def scatter_spec(region: Region, plan: DispatchPlan, target: Target, *ops: Op) -> KernelSpec:
    """One kernel walking the update of `ops` (several: each of the same update shape,
    each stored at its own destination)."""
    args = KernelArgs()
    em = Emitter(region, plan, args, target)
    update = update_shape(em, ops[0])
    for other in ops[1:]:
        shape = update_shape(em, other)
        if len(shape) != len(update) or not all(map(same_dim, shape, update)):
            raise CodegenUnsupported(f"scatters of other update shapes ({update}, {shape})")
    n = numel(update)
    wide = needs_int64(region, plan, extra=[n])
    xmask = Cond("xmask", frozenset({"xindex"}))
    mask = mask_of(xmask)
    u = delinearize(Var("xindex", n), update)
    for op in ops:
        dest, value, accumulate = destination(em, op, u, update, mask)
        out = op.name
        dtype = plan.values[out].dtype
        if accumulate:
            _atomic_add(em, out, dest, em.cast(value, dtype), mask)
        else:
            em.store(out, dest, value, mask, like="xindex")
    n_code = args.dim(n)
    pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    body = [f"xoffset = {pid} * XBLOCK", "xindex = xoffset + tl.arange(0, XBLOCK)",
            f"xmask = xindex < {n_code}"] + em.lines
    name = kernel_name("scatter", region)
    source = module_source(name, args.names() + ["XBLOCK: tl.constexpr"], body, em.helpers,
                           target, args.describe())
    configs, default = pointwise_configs(upper_bound(n, plan.symbols))
    meta = {"numel": str(n), "inplace": True}
    fill = _distinct_indices(em, region, ops)
    if fill:
        meta["timing_fill"] = fill
    return KernelSpec(name, source, args.kernel_args(), ["XBLOCK"], (f"cdiv({n_code}, XBLOCK)",),
                      configs, default, "pointwise", meta, index_bits=64 if wide else 32)


def _distinct_indices(em: Emitter, region: Region, ops) -> dict[str, dict[str, str]]:
    """The tuner's fill for the index inputs of stores that overwrite (not accumulate):
    distinct values below the indexed dim per row. At zeros (the default for integer
    inputs) every update row lands on one destination row, which program stores last
    decides what it holds, and the output check compared that race (a prefill's K/V
    write: 2048 rows into cache row 0, its candidates judged wrong on an H200)."""
    fill = {}
    for op in ops:
        t, a = op.target, op.args
        dest_shape = em.shape(a[0].name)
        if t == "aten.index_put.default" and not bind_args(op)["accumulate"]:
            pairs = [(ix, dest_shape[k]) for k, ix in enumerate(a[1]) if isinstance(ix, Ref)]
        elif t in ("aten.index_copy.default", "aten.scatter.src", "aten.scatter.value"):
            pairs = [(a[2], dest_shape[norm_axis(a[1], len(dest_shape))])]
        else:
            continue
        for ix, dim in pairs:
            name = _input_behind_views(region, ix)
            if name is not None:
                fill[name] = {"choose_from": to_str(dim)}
    return fill


def _input_behind_views(region: Region, ref) -> str | None:
    """The region input `ref` reads through view ops (a position [T] viewed [1, T]), or
    None when it is computed in the region."""
    ops = {o.name: o for o in region.ops}
    while isinstance(ref, Ref) and ref.name in ops:
        op = ops[ref.name]
        if category(op.target) != OpCategory.VIEW or not op.args:
            return None
        ref = op.args[0]
    return ref.name if isinstance(ref, Ref) and ref.name in region.inputs else None


def update_shape(em: Emitter, op: Op) -> tuple:
    """The shape of the elements the scatter writes (what the kernel walks)."""
    t = op.target
    a = op.args
    dest_shape = em.shape(a[0].name)
    if t == "aten.index_put.default":
        return indexed_shape(em, dest_shape, a[1])
    if t in ("aten.index_copy.default", "aten.index_add.default"):
        return em.shape(a[3].name)
    if t in ("aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default"):
        return em.shape(a[2].name)
    if t in SLICE_SCATTERS:
        return em.shape(a[1].name)
    raise CodegenUnsupported(f"{t} is not generated")


def destination(em: Emitter, op: Op, u, update, mask):
    """(destination index, value written, accumulate?) for update element `u`."""
    t = op.target
    a = op.args
    dest_shape = em.shape(a[0].name)

    def src_at(ref, idx):
        if not isinstance(ref, Ref):
            raise CodegenUnsupported(f"{t} with a non-tensor source")
        return em.value(ref.name, broadcast_index(idx, update, em.shape(ref.name)), mask)

    if t == "aten.index_put.default":
        accumulate = bool(bind_args(op)["accumulate"])
        dest = advanced_index(em, dest_shape, a[1], update, u, mask, what=t)
        return dest, src_at(a[2], u), accumulate
    if t in ("aten.index_copy.default", "aten.index_add.default"):
        d = norm_axis(a[1], len(dest_shape))
        row = _index_value(em, a[2], (u[d],), mask, dest_shape[d], wrap=True, what=t)
        v = src_at(a[3], u)
        alpha = bind_args(op)["alpha"]
        if t == "aten.index_add.default" and alpha != 1:
            v = em.let(f"{v} * {alpha!r}", v.dtype, v.vars)
        return u[:d] + (row,) + u[d + 1:], v, t == "aten.index_add.default"
    if t in ("aten.scatter.src", "aten.scatter.value", "aten.scatter_add.default"):
        d = norm_axis(a[1], len(dest_shape))
        row = _index_value(em, a[2], u, mask, dest_shape[d], wrap=True, what=t)
        if t == "aten.scatter.value":
            from kiln.codegen.expr.values import literal

            v = literal(a[3], em.dtype(a[0].name))
        else:
            v = src_at(a[3], u)
        return u[:d] + (row,) + u[d + 1:], v, t == "aten.scatter_add.default"
    if t in SLICE_SCATTERS:
        b = bind_args(op)
        d = norm_axis(b["dim"], len(dest_shape))
        if t == "aten.select_scatter.default":
            k = select_index(b["index"], dest_shape[d])
            return u[:d] + (Lin.of(k),) + u[d:], src_at(b["src"], u), False
        start, _, step = slice_bounds(b, dest_shape[d], em.shape(b["src"].name)[d])
        return u[:d] + (Lin.of(start) + u[d] * step,) + u[d + 1:], src_at(b["src"], u), False
    raise CodegenUnsupported(f"{t} is not generated")


def _atomic_add(em: Emitter, out: str, dest, v, mask) -> None:
    from kiln.codegen.expr.indexing import linearize

    dtype = em.plan.values[out].dtype
    if dtype not in ATOMIC_DTYPES:
        raise CodegenUnsupported(f"accumulating scatter into {dtype} (atomics: fp32/int32)")
    shape = em.plan.values[out].shape
    ptr = em.args.tensor(out, dtype, shape, output=True)
    off = em.code(linearize(tuple(dest), shape))
    em.lines.append(f"tl.atomic_add({ptr} + ({off}), {v}, mask=xmask)")
