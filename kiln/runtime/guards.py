"""Check a call's arguments against the compiled signature and bind the size symbols.

Every mismatch is a KilnError naming the argument, the dim and the bound, so a caller
learns what to change instead of meeting a failure inside a kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch

from kiln.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from kiln.ir.plan import DispatchPlan, TensorValue
from kiln.ir.printer import dtype_str, type_str
from kiln.ir.symbolic import evaluate, shape_str, to_str


def _arg_name(names: Sequence[str] | None, i: int, value: TensorValue) -> str:
    if names and i < len(names):
        return f"argument {names[i]!r}"
    return f"argument {i} ({value.name})"


def dim_label(plan: DispatchPlan, sym: str) -> str:
    """How messages name a size symbol: the user's Dim name first (`dim "seq" (s17)`)."""
    name = plan.dim_names.get(sym)
    return f'dim "{name}" ({sym})' if name else f"dim {sym}"


def _expr_str(plan: DispatchPlan, expr) -> str:
    """A size expression, with the Dim names of its symbols after it."""
    named = [f'{s.name} is dim "{plan.dim_names[s.name]}"'
             for s in sorted(expr.free_symbols, key=lambda s: s.name) if s.name in plan.dim_names]
    return to_str(expr) + (f" ({', '.join(named)})" if named else "")


def bind_symbols(plan: DispatchPlan, args: Sequence, device: str | None = None,
                 names: Sequence[str] | None = None) -> dict[str, int]:
    """Check `args` (flattened user inputs) and return each size symbol's value."""
    if len(args) != len(plan.user_inputs):
        raise ArgumentError(
            f"the compiled module takes {len(plan.user_inputs)} tensor arguments, "
            f"got {len(args)}",
            hint="call it with the same arguments (and structure) as the example args",
        )
    env: dict[str, int] = {}
    pending: list[tuple[int, int, sympy.Expr, int]] = []
    for i, (arg, vname) in enumerate(zip(args, plan.user_inputs)):
        v = plan.values[vname]
        who = _arg_name(names, i, v)
        if not isinstance(arg, torch.Tensor):
            raise ArgumentError(f"{who} must be a tensor, got {type(arg).__name__}",
                                hint=f"pass a tensor of type {type_str(v.shape, v.dtype)}")
        if arg.dtype != v.dtype:
            raise DTypeError(
                f"{who} has dtype {dtype_str(arg.dtype)}, the module was compiled for "
                f"{dtype_str(v.dtype)}",
                hint=f"convert it with .to({v.dtype}) or recompile with an example of that dtype",
            )
        if device is not None and arg.device.type != device:
            raise DeviceError(
                f"{who} is on {arg.device}, the module runs on {device}",
                hint=f"move it with .to('{device}')",
            )
        if arg.dim() != len(v.shape):
            raise ShapeError(
                f"{who} has {arg.dim()} dims {list(arg.shape)}, expected {len(v.shape)}: "
                f"{shape_str(v.shape)}"
            )
        for d, (size, want) in enumerate(zip(arg.shape, v.shape)):
            if isinstance(want, int):
                if size != want:
                    raise ShapeError(
                        f"{who} has size {size} in dim {d}, the module was compiled for {want}",
                        hint="mark that dim dynamic in dynamic_shapes to accept other sizes",
                    )
            elif isinstance(want, sympy.Symbol):
                _bind(plan, env, want.name, int(size), who, d)
            else:
                pending.append((i, d, want, int(size)))
    for i, d, expr, size in pending:
        if evaluate(expr, env) != size:
            who = _arg_name(names, i, plan.values[plan.user_inputs[i]])
            raise ShapeError(
                f"{who} has size {size} in dim {d}, but that dim must equal "
                f"{_expr_str(plan, expr)} = {evaluate(expr, env)}"
            )
    return env


def _bind(plan: DispatchPlan, env: dict[str, int], sym: str, size: int, who: str, d: int):
    if sym in env and env[sym] != size:
        raise ShapeError(
            f"{who} has size {size} in dim {d}, but {dim_label(plan, sym)} is already "
            f"{env[sym]} from an earlier argument",
            hint="dims that share a torch.export.Dim must have equal sizes",
        )
    bounds = plan.symbols.get(sym)
    if bounds is not None and not bounds.contains(size):
        raise ShapeError(
            f"{who} has size {size} in dim {d}, outside the bounds of {dim_label(plan, sym)}: "
            f"{bounds}",
            where=f"dim {d} of {who}",
            hint="call with a size inside the bounds, or recompile with wider "
            "torch.export.Dim(min=, max=)",
        )
    env[sym] = size
