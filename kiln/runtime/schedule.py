"""The schedule stage: plan memory for the kernel plan and assemble the Program."""

from __future__ import annotations

from kiln.codegen.kernel_plan import KernelPlan
from kiln.pipeline import as_pass
from kiln.runtime.memory_plan import plan_memory
from kiln.runtime.program import Program


def size_hints(kplan: KernelPlan, example_env: dict[str, int] | None) -> dict[str, int]:
    """Sizes to rank buffers by: the example's, else each dim's upper (or lower) bound."""
    hints = dict(example_env or {})
    for name, b in kplan.plan.symbols.items():
        if name not in hints:
            hints[name] = b.hi if b.hi is not None else max(b.lo, 1)
    return hints


@as_pass
def schedule(kplan: KernelPlan, ctx) -> Program:
    hints = size_hints(kplan, ctx.options.get("example_env"))
    return Program(kplan, plan_memory(kplan.plan, hints))
