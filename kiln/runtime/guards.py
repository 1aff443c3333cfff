"""Check a call's arguments against the compiled signature and bind the size symbols.

Every mismatch is a KilnError naming the argument, the dim and the bound, so a caller
learns what to change instead of meeting a failure inside a kernel.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence

import sympy
import torch

from kiln.errors import ArgumentError, DeviceError, DTypeError, ShapeError
from kiln.ir.plan import DispatchPlan, TensorValue
from kiln.ir.printer import dtype_str, type_str
from kiln.ir.symbolic import compile_expr, evaluate, shape_str, to_str

# a size check's relation (plan.size_checks: lhs - rhs against 0)
_HOLDS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
          "==": operator.eq, "!=": operator.ne}


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
                 names: Sequence[str] | None = None, sizes: Sequence = ()) -> dict[str, int]:
    """Check `args` (flattened tensor inputs) and `sizes` (the dynamic int arguments, in
    plan.size_args order) and return each size symbol's value."""
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
    _bind_sizes(plan, env, sizes)
    _solve_derived(plan, env, pending, names)
    for i, d, expr, size in pending:
        if evaluate(expr, env) != size:
            who = _arg_name(names, i, plan.values[plan.user_inputs[i]])
            raise ShapeError(
                f"{who} has size {size} in dim {d}, but that dim must equal "
                f"{_expr_str(plan, expr)} = {evaluate(expr, env)}"
            )
    _check_sizes(plan, env)
    return env


def _bind_sizes(plan: DispatchPlan, env: dict[str, int], sizes: Sequence) -> None:
    """The dynamic int arguments' symbols, each checked against its Dim's bounds."""
    if len(sizes) != len(plan.size_args):
        raise ArgumentError(
            f"the compiled module takes {len(plan.size_args)} int size arguments "
            f"({', '.join(repr(n) for _, n, _ in plan.size_args) or 'none'}), got {len(sizes)}",
            hint="call it with the same arguments (and structure) as the example args")
    for (_, name, sym), value in zip(plan.size_args, sizes):
        who = f"argument {name!r}"
        if not isinstance(value, int) or isinstance(value, bool):
            raise ArgumentError(f"{who} must be a Python int (a size), got "
                                f"{type(value).__name__}", where=who,
                                hint="pass an int, as in the example arguments")
        bounds = plan.symbols.get(sym)
        if bounds is not None and not bounds.contains(value):
            raise ShapeError(
                f"{who} is {value}, outside the bounds of {dim_label(plan, sym)}: {bounds}",
                where=who,
                hint=f"call with {name} inside the bounds, or recompile with a wider "
                "torch.export.Dim(min=, max=) for it in dynamic_shapes")
        if sym in env and env[sym] != value:
            raise ShapeError(
                f"{who} is {value}, but {dim_label(plan, sym)} is already {env[sym]} from a "
                "tensor argument's size", where=who,
                hint="the model ties this int to that size: pass equal values")
        env[sym] = value


def _check_sizes(plan: DispatchPlan, env: dict[str, int]) -> None:
    """The conditions torch assumed of the int arguments (a slice within its tensor)."""
    for diff, rel, text in plan.size_checks:
        if not _HOLDS[rel](evaluate(diff, env), 0):
            used = sorted(s.name for s in getattr(diff, "free_symbols", ()))
            named = ", ".join(f"{dim_label(plan, s)} = {env[s]}" for s in used)
            args = ", ".join(f"{n!r} = {env[s]}" for _, n, s in plan.size_args)
            raise ShapeError(
                f"the call's sizes break a condition the model's code needs: "
                f"{_named_symbols(plan, text)} "
                f"({named})", where=f"arguments {args}",
                hint="the model slices or shapes a tensor with these sizes and only this "
                "holds for them (a KV cache's length bounds start_pos + seqlen): call with "
                "sizes that meet it")


def _named_symbols(plan: DispatchPlan, text: str) -> str:
    """A condition's text with each symbol a Dim names written as that name (`start + seq
    <= 16`, not `s3 + s7 <= 16`): what the user wrote in dynamic_shapes."""
    return re.sub(r"\bs\d+\b", lambda m: plan.dim_names.get(m.group(0), m.group(0)), text)


def _solve_derived(plan: DispatchPlan, env: dict[str, int], pending: list, names) -> None:
    """Bind the symbols that only appear inside a size expression: a derived Dim
    (`10 * s`, `s + 1`) gives an input dim the affine `a*s + b` and no dim `s` itself."""
    progress = True
    while progress:
        progress = False
        for i, d, expr, size in pending:
            free = [s for s in expr.free_symbols if s.name not in env]
            if len(free) != 1:
                continue
            sym = free[0]
            affine = sympy.Poly(expr.subs({s: env[s.name] for s in expr.free_symbols
                                           if s.name in env}), sym) \
                if expr.is_polynomial(sym) else None
            if affine is None or affine.degree() != 1:
                continue
            a, b = (int(c) for c in affine.all_coeffs())
            who = _arg_name(names, i, plan.values[plan.user_inputs[i]])
            if (size - b) % a:
                raise ShapeError(
                    f"{who} has size {size} in dim {d}, but that dim must be "
                    f"{_expr_str(plan, expr)} for an integer {sym.name}",
                    where=f"dim {d} of {who}",
                    hint="call with a size of that form, or recompile with another Dim")
            value = (size - b) // a
            _bind(plan, env, sym.name, value, who, d,
                  shown=f"{size} ({_expr_str(plan, expr)} with {sym.name} = {value})")
            progress = True


def _bind(plan: DispatchPlan, env: dict[str, int], sym: str, size: int, who: str, d: int,
          shown: str | None = None):
    shown = shown or str(size)
    if sym in env and env[sym] != size:
        raise ShapeError(
            f"{who} has size {shown} in dim {d}, but {dim_label(plan, sym)} is already "
            f"{env[sym]} from an earlier argument",
            hint="dims that share a torch.export.Dim must have equal sizes",
        )
    bounds = plan.symbols.get(sym)
    if bounds is not None and not bounds.contains(size):
        raise ShapeError(
            f"{who} has size {shown} in dim {d}, outside the bounds of {dim_label(plan, sym)}: "
            f"{bounds}",
            where=f"dim {d} of {who}",
            hint="call with a size inside the bounds, or recompile with wider "
            "torch.export.Dim(min=, max=)",
        )
    env[sym] = size


class FastBinder:
    """bind_symbols' checks for a well-formed call, without its messages: the sizes, or
    None for anything else (then bind_symbols says what is wrong). A call at known
    sizes is host work on the CPU target, and these checks run on every call."""

    def __init__(self, plan: DispatchPlan, device: str | None = None):
        self.plan = plan
        self.device_flag = {"cpu": "is_cpu", "cuda": "is_cuda"}.get(device) if device else None
        self.usable = device is None or self.device_flag is not None
        self.specs = []
        for name in plan.user_inputs:
            v = plan.values[name]
            static, syms = [], []
            for d, want in enumerate(v.shape):
                if isinstance(want, int):
                    static.append((d, want))
                elif isinstance(want, sympy.Symbol):
                    b = plan.symbols.get(want.name)
                    syms.append((d, want.name, b.lo if b else 0,
                                 b.hi if b is not None and b.hi is not None else float("inf")))
                else:  # a size expression: bind_symbols evaluates it
                    self.usable = False
            self.specs.append((v.dtype, len(v.shape), static, syms))
        self.sizes = []
        for _, _, sym in plan.size_args:
            b = plan.symbols.get(sym)
            self.sizes.append((sym, b.lo if b else 0,
                               b.hi if b is not None and b.hi is not None else float("inf")))
        self.checks = [(compile_expr(d) if not isinstance(d, int) else (lambda env, d=d: d),
                        _HOLDS[rel]) for d, rel, _ in plan.size_checks]

    def __call__(self, args: Sequence, sizes: Sequence = ()) -> dict[str, int] | None:
        if not self.usable or len(args) != len(self.specs) or len(sizes) != len(self.sizes):
            return None
        env: dict[str, int] = {}
        flag = self.device_flag
        for a, (dtype, rank, static, syms) in zip(args, self.specs):
            if not isinstance(a, torch.Tensor) or a.dtype != dtype:
                return None
            if flag is not None and not getattr(a, flag):
                return None
            shape = a.shape
            if len(shape) != rank:
                return None
            for d, want in static:
                if shape[d] != want:
                    return None
            for d, sym, lo, hi in syms:
                size = shape[d]
                if not lo <= size <= hi or env.setdefault(sym, size) != size:
                    return None
        for value, (sym, lo, hi) in zip(sizes, self.sizes):
            if type(value) is not int or not lo <= value <= hi \
                    or env.setdefault(sym, value) != value:
                return None
        for fn, holds in self.checks:
            if not holds(fn(env), 0):
                return None
        return env
