"""Choose a kernel for every region of the plan, for the compile's target.

On the CPU every region runs as PyTorch ops (TorchKernel): the same plan, memory
planning and scheduling as on a GPU, so the whole pipeline is testable anywhere.
"""

from __future__ import annotations

from kiln.codegen.kernel_plan import KernelPlan
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import DispatchPlan
from kiln.pipeline import as_pass


@as_pass
def select_kernels(plan: DispatchPlan, ctx) -> KernelPlan:
    target = ctx.target
    kp = KernelPlan(plan, target)
    for region in plan.regions:
        kp.kernels[region.name] = TorchKernel(region, target.torch_device)
    return kp
