"""Pointwise regions (and gather / concat-only copy regions) as one flat Triton kernel.

The kernel walks the output's elements in row-major order, XBLOCK per program, with a
tail mask (no padding). Each element's index is the flat position delinearized over
the output shape; the emitter turns the region's ops into code at that index, so a
contiguous access simplifies back to `xindex` and Triton vectorises it.
"""

from __future__ import annotations

import triton

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source, needs_int64
from kiln.codegen.expr.indexing import Var, delinearize
from kiln.codegen.expr.kernel_args import KernelArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, mask_of
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import numel, same_dim, upper_bound
from kiln.target import Target

BLOCKS = (128, 256, 512, 1024, 2048)
WARPS = (1, 2, 4, 8)


def generate_pointwise(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The region as one flat kernel; raises CodegenUnsupported saying why it declines."""
    return pointwise_spec(region, plan, target)


def pointwise_spec(region: Region, plan: DispatchPlan, target: Target,
                   kind: str = "pointwise") -> KernelSpec:
    """One flat kernel over the region's output (`kind` names it: pointwise or copy)."""
    shapes = [plan.values[o].shape for o in region.outputs]
    shape = shapes[0]
    if any(len(s) != len(shape) or not all(same_dim(a, b) for a, b in zip(s, shape))
           for s in shapes):
        raise CodegenUnsupported("outputs of different shapes")
    n = numel(shape)
    wide = needs_int64(region, plan)
    args = KernelArgs()
    em = Emitter(region, plan, args, target)
    x = Var("xindex", n)
    xmask = Cond("xmask", frozenset({"xindex"}))
    index = delinearize(x, shape)
    for o in region.outputs:
        v = em.value(o, index, mask_of(xmask))
        em.store(o, index, v, mask_of(xmask), like="xindex")
    n_code = args.dim(n)
    pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
    body = [f"xoffset = {pid} * XBLOCK",
            "xindex = xoffset + tl.arange(0, XBLOCK)",
            f"xmask = xindex < {n_code}"] + em.lines
    name = kernel_name(kind, region)
    source = module_source(name, args.names() + ["XBLOCK: tl.constexpr"], body, em.helpers,
                           target, args.describe())
    configs, default = pointwise_configs(upper_bound(n, plan.symbols))
    return KernelSpec(name, source, args.kernel_args(), ["XBLOCK"], (f"cdiv({n_code}, XBLOCK)",),
                      configs, default, "pointwise", {"numel": str(n)},
                      index_bits=64 if wide else 32)


def pointwise_configs(max_numel: int | None) -> tuple[list[Config], Config]:
    """XBLOCK x num_warps candidates no larger than the work, and the heuristic default:
    1024 elements over 4 warps (16-byte vectors per thread for fp32 and fp16) when the
    work is large, one small block when it is not."""
    cap = triton.next_power_of_2(max_numel) if max_numel else max(BLOCKS)
    blocks = [b for b in BLOCKS if b <= max(cap, BLOCKS[0])]
    configs = [Config.make(w, 1, XBLOCK=b) for b in blocks for w in WARPS if b >= 32 * w]
    xb = min(1024, max(cap, 32 if cap < BLOCKS[0] else BLOCKS[0]))
    warps = max(1, min(4, xb // 256))
    default = Config.make(warps, 1, XBLOCK=xb)
    if default not in configs:
        configs.append(default)
    return configs, default
