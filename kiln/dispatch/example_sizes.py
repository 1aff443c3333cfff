"""The example arguments' size for each size symbol, once the plan exists.

The tuner times kernels at these sizes and `kiln explain` reports costs at them. The
example already passed torch.export, so its sizes satisfy the plan: reading each
symbol off the first input dim that is exactly that symbol is enough (no checks). A
plan compiled again for narrower sizes (dispatch/narrow_rows.py: one row of a batch
of up to 4) takes the example's size clamped into its bounds: its kernels are tuned
at the sizes it runs.
"""

from __future__ import annotations

import sympy
import torch

from kiln.ir.plan import DispatchPlan
from kiln.pipeline import Context, Pass


def example_sizes(plan: DispatchPlan, leaves: list) -> dict[str, int]:
    """symbol -> size in the example args (`leaves`: the flattened (args, kwargs))."""
    sized = {i: sym for i, _, sym in plan.size_args}
    tensors = [x for i, x in enumerate(leaves) if i not in plan.const_args and i not in sized]
    env: dict[str, int] = {sym: int(leaves[i]) for i, sym in sized.items() if i < len(leaves)}
    for arg, name in zip(tensors, plan.user_inputs):
        if not isinstance(arg, torch.Tensor):
            continue
        for size, want in zip(arg.shape, plan.values[name].shape):
            if isinstance(want, sympy.Symbol):
                env.setdefault(want.name, int(size))
    return {sym: _clamped(n, plan.symbols.get(sym)) for sym, n in env.items()}


def _clamped(n: int, bounds) -> int:
    if bounds is None:
        return n
    n = max(n, bounds.lo)
    return n if bounds.hi is None else min(n, bounds.hi)


def _bind_example(plan: DispatchPlan, ctx: Context) -> DispatchPlan:
    leaves = ctx.options.get("example_leaves")
    if leaves is not None:
        ctx.options["example_env"] = example_sizes(plan, leaves)
    return plan


bind_example_sizes = Pass("example_sizes", _bind_example)
