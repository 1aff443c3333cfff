"""Choose a kernel for every region of the plan, for the compile's target.

On the CPU every region runs as PyTorch ops (TorchKernel): the same plan, memory
planning and scheduling as on a GPU, so the whole pipeline is testable anywhere.
For Triton targets each region kind has a generator (registered in GENERATORS) that
turns the region into a KernelSpec; the tuner picks a config that compiles and fits
the target. A region with no generator, or whose every config fails, runs as its
extern form (torch ops on the device: cuBLAS, SDPA), and the reason is noted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kiln.codegen.kernel_plan import KernelPlan
from kiln.codegen.torch_kernel import TorchKernel
from kiln.codegen.triton.spec import KernelSpec
from kiln.ir.plan import DispatchPlan, Region, RegionKind
from kiln.pipeline import as_pass
from kiln.target import Target

log = logging.getLogger("kiln.codegen")

Generator = Callable[[Region, DispatchPlan, Target], KernelSpec | None]
GENERATORS: dict[RegionKind, Generator] = {}


def register(kind: RegionKind):
    def wrap(fn: Generator) -> Generator:
        GENERATORS[kind] = fn
        return fn

    return wrap


def _load_generators() -> None:
    """Import the generator modules so they register themselves."""
    import kiln.codegen.triton.generators  # noqa: F401


def kernel_for(region: Region, plan: DispatchPlan, target: Target, ctx):
    from kiln.codegen.fit import fitted_spec
    from kiln.codegen.tune import choose

    gen = GENERATORS.get(region.kind)
    # Only configs that can fit the target; may split the region (new regions in plan).
    spec = fitted_spec(region, plan, target, gen) if gen else None
    if spec is None:
        if not any(n.startswith("extern") for n in region.notes):
            region.notes.append(f"extern: no Triton generator handles this "
                                f"{region.kind.value} region")
        return TorchKernel(region, target.torch_device)
    return choose(region, spec, target, ctx, plan)


@as_pass
def select_kernels(plan: DispatchPlan, ctx) -> KernelPlan:
    target = ctx.target
    kp = KernelPlan(plan, target)
    if target.uses_triton:
        _load_generators()
    pending = list(plan.regions)
    while pending:
        region = pending.pop(0)
        if target.uses_triton:
            kp.kernels[region.name] = kernel_for(region, plan, target, ctx)
        else:
            kp.kernels[region.name] = TorchKernel(region, target.torch_device)
        # A split inserts regions before the one it split: they need kernels too.
        pending += [r for r in plan.regions if r.name not in kp.kernels and r not in pending]
    return kp
