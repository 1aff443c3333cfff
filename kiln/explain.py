"""The `kiln explain` report: what was compiled, where it came from, what it costs.

Per region: its name, kind and label, its outputs' symbolic shapes, the user's source
lines it came from, its notes (why it is extern, why it was split), and bytes moved
and flops (kiln.dispatch.cost) at the example sizes and at the upper bounds. Then the
symbols with their bounds, totals, and the memory planner's peak against the sum of
all intermediates. `kernels=True` adds each region's kernel (Triton source included).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter

import sympy
import torch
import torch.utils._pytree as pytree

from kiln.dispatch.cost import ZERO, Cost, plan_costs
from kiln.ir.plan import DispatchPlan, Role
from kiln.ir.printer import type_str
from kiln.ir.symbolic import Bounds, Dim, bounds_of, evaluate, to_str


def explain(program, example_sizes: dict[str, int] | None = None,
            dim_names: dict[str, str] | None = None, kernels: bool = False) -> str:
    plan: DispatchPlan = program.plan
    example = _full_env(plan, example_sizes or {})
    upper = _upper_env(plan.symbols)
    costs = plan_costs(plan)
    kinds = Counter(r.kind.value for r in plan.regions)
    out = [f"kiln explain: {len(plan.regions)} regions for {program.kplan.target} ("
           + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")"]
    out += _symbols(plan.symbols, example, dim_names or {})
    out.append("")
    for r in plan.regions:
        out += _region(r, plan, costs[r.name], example, kernels and program.kplan.kernels)
        out.append("")
    total = sum(costs.values(), ZERO)
    out.append("total")
    out += _cost_lines(total, plan.symbols, example, indent="  ")
    out += _weights(plan)
    out += _memory(program.mem, example, upper)
    return "\n".join(out) + "\n"


# ---- sizes ----------------------------------------------------------------------------


def _full_env(plan: DispatchPlan, sizes: dict[str, int]) -> dict[str, int] | None:
    """The example's sizes when every symbol has one, else None (unknown)."""
    if all(s in sizes for s in plan.symbols):
        return {s: sizes[s] for s in plan.symbols}
    return None


def _upper_env(symbols: dict[str, Bounds]) -> dict[str, int] | None:
    if any(b.hi is None for b in symbols.values()):
        return None
    return {s: b.hi for s, b in symbols.items()}


def _symbols(symbols: dict[str, Bounds], example, dim_names: dict[str, str]) -> list[str]:
    if not symbols:
        return ["symbols: none (every size is static)"]
    named = {sym: name for name, sym in dim_names.items()}
    lines = ["symbols:"]
    for s, b in sorted(symbols.items()):
        label = f"{s} ({named[s]})" if s in named else s
        ex = f"   example {example[s]}" if example else ""
        lines.append(f"  {label} in {b}{ex}" + ("   (unbounded)" if b.hi is None else ""))
    return lines


# ---- regions --------------------------------------------------------------------------


def _region(r, plan: DispatchPlan, cost: Cost, example, kernels) -> list[str]:
    label = getattr(r, "label", None)
    head = f"{r.name} {r.kind.value}" + (f" [{label}]" if label else "")
    outs = ", ".join(f"%{o}: {type_str(plan.values[o].shape, plan.values[o].dtype)}"
                     for o in r.outputs)
    lines = [f"{head} -> {outs}"]
    for o, state in r.inplace.items():
        lines.append(f"  writes %{o} in place into {plan.values[state].target or state}")
    lines += [f"  at {_short_where(w)}" for w in r.where()]
    lines += [f"  note: {n}" for n in r.notes]
    lines += _cost_lines(cost, plan.symbols, example, indent="  ")
    if kernels:
        k = kernels.get(r.name)
        text = k.describe().rstrip() if k is not None else "(no kernel)"
        lines.append("  kernel: " + text.replace("\n", "\n    "))
    return lines


def _short_where(w: str) -> str:
    """A source line with its path relative to the working directory when inside it."""
    path, sep, rest = w.partition(":")
    if sep and os.path.isabs(path):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel + sep + rest
    return w


def _cost_lines(cost: Cost, symbols, example, indent: str) -> list[str]:
    return [
        f"{indent}bytes {_at(cost.bytes, symbols, example, human_bytes)}",
        f"{indent}flops {_at(cost.flops, symbols, example, human_flops)}",
    ]


def _at(expr: Dim, symbols, example, fmt) -> str:
    """`expr` at the example sizes and at the upper bounds, plus its formula if symbolic."""
    if isinstance(expr, int) or not expr.free_symbols:
        return fmt(int(expr))
    parts = [f"{fmt(evaluate(expr, example))} at example" if example else "example unknown"]
    hi = bounds_of(expr, symbols).hi
    parts.append(f"{fmt(hi)} at max" if hi is not None else "unbounded at max")
    return ", ".join(parts) + f"   = {to_str(sympy.expand(expr))}"


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def human_flops(n: int) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n}" if unit == "" else f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} P"


# ---- weights and memory -----------------------------------------------------------------


def _weights(plan: DispatchPlan) -> list[str]:
    weights = [v for v in plan.values.values() if v.role in (Role.WEIGHT, Role.STATE)]
    fixed = sum(evaluate(v.numel, {}) * v.itemsize for v in weights
                if all(isinstance(d, int) for d in v.shape))
    state = sum(1 for v in weights if v.role == Role.STATE)
    return [f"weights: {len(weights)} tensors ({state} updated in place), {human_bytes(fixed)}"]


def _memory(mem, example, upper) -> list[str]:
    lines = [f"memory: {len(mem.nbytes)} intermediates planned into {len(mem.slots)} slots"]
    for what, env in (("example", example), ("max", upper)):
        if env is None:
            lines.append(f"  at {what} sizes: " + ("unknown" if what == "example" else
                                                   "unbounded"))
            continue
        peak, total = mem.peak_bytes(env), mem.total_bytes(env)
        saved = f" (reuse saves {100 * (1 - peak / total):.0f}%)" if peak < total else ""
        lines.append(f"  at {what} sizes: peak planned {human_bytes(peak)} vs "
                     f"{human_bytes(total)} for all intermediates{saved}")
    return lines


# ---- naming the size symbols ------------------------------------------------------------


def dim_names(model, args: tuple, kwargs: dict, dynamic_shapes, plan: DispatchPlan) -> dict:
    """torch.export.Dim name -> plan symbol, read off the user's dynamic_shapes.

    Best effort, for reports and `kiln run --size seq=N`: a spec it cannot follow
    (derived dims, unusual nesting) simply leaves that dim unnamed.
    """
    if dynamic_shapes is None:
        return {}
    leaves = pytree.tree_leaves((args, kwargs))
    tensors = [x for i, x in enumerate(leaves) if i not in plan.const_args]
    value_of = {id(t): plan.values[n] for t, n in zip(tensors, plan.user_inputs)}
    names: dict[str, str] = {}
    for value, spec in _pair_inputs(model, args, kwargs, dynamic_shapes):
        _walk(value, spec, value_of, names)
    return names


def _pair_inputs(model, args, kwargs, dynamic_shapes):
    if isinstance(dynamic_shapes, dict):
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs)
        except (TypeError, ValueError):
            return []
        return [(v, dynamic_shapes.get(k)) for k, v in bound.arguments.items()]
    if isinstance(dynamic_shapes, (list, tuple)):
        return list(zip([*args, *kwargs.values()], dynamic_shapes))
    return []


def _walk(value, spec, value_of, names: dict[str, str]) -> None:
    if spec is None:
        return
    if isinstance(value, torch.Tensor):
        tv = value_of.get(id(value))
        dims = spec.items() if isinstance(spec, dict) else enumerate(spec) \
            if isinstance(spec, (list, tuple)) else ()
        for d, dim in dims:
            name = getattr(dim, "__name__", None)
            if tv is None or not isinstance(name, str) or not isinstance(d, int) \
                    or not -len(tv.shape) <= d < len(tv.shape):
                continue
            sym = tv.shape[d]
            if isinstance(sym, sympy.Symbol):
                names.setdefault(name, sym.name)
    elif isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        for v, s in zip(value, spec):
            _walk(v, s, value_of, names)
    elif isinstance(value, dict) and isinstance(spec, dict):
        for k, v in value.items():
            _walk(v, spec.get(k), value_of, names)
