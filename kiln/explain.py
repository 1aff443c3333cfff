"""The `kiln explain` report: what was compiled, where it came from, what it costs.

Per region: its name, kind and label, its outputs' symbolic shapes, the user's source
lines it came from, its notes (why it is extern, why it was split), and bytes moved
and flops (kiln.dispatch.cost) at the example sizes and at the upper bounds. Then the
symbols with their bounds, totals, and the memory planner's peak against the sum of
all intermediates. `kernels=True` adds each region's kernel (Triton source included).
"""

from __future__ import annotations

import os
from collections import Counter

import sympy

from kiln.dispatch.cost import ZERO, Cost, plan_costs
from kiln.ir.plan import DispatchPlan, Role
from kiln.ir.printer import type_str
from kiln.ir.symbolic import Bounds, Dim, bounds_of, evaluate, to_str
from kiln.ops.moe_experts import routing_bound
from kiln.progress import top_level

MOE_OPS = ("kiln.moe_experts.default", "kiln.moe_experts_fp8.default")  # ids, gate: args 2, 3


def explain(program, example_sizes: dict[str, int] | None = None,
            kernels: bool = False, parallel=None,
            timings: dict[str, float] | None = None) -> str:
    plan: DispatchPlan = program.plan
    example = _full_env(plan, example_sizes or {})
    upper = _upper_env(plan.symbols)
    costs = plan_costs(plan)
    kinds = Counter(r.kind.value for r in plan.regions)
    out = [f"kiln explain: {len(plan.regions)} regions for {program.kplan.target} ("
           + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")"]
    out += _symbols(plan.symbols, example, plan.dim_names)
    out += _size_args(plan)
    out += _narrow(program)
    if parallel is not None:
        out += _device(plan, parallel, example)
    out.append("")
    for r in plan.regions:
        out += _region(r, plan, costs[r.name], example, kernels and program.kplan.kernels)
        out.append("")
    total = sum(costs.values(), ZERO)
    out.append("total")
    out += _cost_lines(total, plan.symbols, example, indent="  ")
    out += _weights(plan)
    out += _stage_io(plan, example)
    out += _memory(program.mem, example, upper)
    out += _compile_time(timings or {})
    narrow = getattr(program, "narrow", None)
    if kernels and narrow is not None:  # its regions and kernels too, at its sizes
        sizes = {k: min(v, narrow.hi) if k in narrow.program.plan.symbols
                 and narrow.program.plan.symbols[k].hi == narrow.hi else v
                 for k, v in (example_sizes or {}).items()}
        out += ["", f"== the narrow version ({narrow.symbol} <= {narrow.hi}) =="]
        out += explain(narrow.program, sizes, kernels=True).splitlines()
    return "\n".join(out) + "\n"


def _narrow(program) -> list[str]:
    """The narrow version a call at small sizes runs instead (runtime/program.py)."""
    n = getattr(program, "narrow", None)
    if n is None:
        return []
    plan = n.program.plan
    kinds = Counter(r.kind.value for r in plan.regions)
    name = program.plan.dim_names.get(n.symbol)
    dim = f"{name} ({n.symbol})" if name else n.symbol
    return [f"narrow version: calls with {dim} <= {n.hi} run a plan of their own, "
            f"{len(plan.regions)} regions ("
            + ", ".join(f"{c} {k}" for k, c in sorted(kinds.items()))
            + "): their products as GEMVs"]


def _compile_time(timings: dict[str, float], shown: float = 0.01) -> list[str]:
    """Where the compile's time went: each phase of at least `shown` seconds, the
    longest first, its parts below it (none for a loaded module)."""
    if not timings:
        return []
    tops = top_level(timings)
    out = [f"compile time {sum(tops.values()):.2f} s"]

    def walk(keys, depth: int, name) -> None:
        small = [k for k in keys if timings[k] < shown]
        for k in sorted(set(keys) - set(small), key=timings.get, reverse=True):
            out.append(f"{'  ' * depth}{name(k)}: {timings[k]:.2f} s")
            walk([c for c in timings if c.startswith(k + "/") and "/" not in
                  c[len(k) + 1:]], depth + 1, lambda c: c.rpartition("/")[2])
        if small:
            out.append(f"{'  ' * depth}{len(small)} more: "
                       f"{sum(timings[k] for k in small):.2f} s")

    walk(list(tops), 1, str)
    return out


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


def _size_args(plan: DispatchPlan) -> list[str]:
    """The int arguments that bind a symbol, and the conditions every call must meet."""
    lines = [f"  {sym} is argument {name!r} (a Python int)" for _, name, sym in plan.size_args]
    lines += [f"  every call: {text}" for _, _, text in plan.size_checks]
    return lines


def _symbols(symbols: dict[str, Bounds], example, named: dict[str, str]) -> list[str]:
    """One line per size symbol, with the user's Dim name (`named`: symbol -> name)."""
    if not symbols:
        return ["symbols: none (every size is static)"]
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
    lines += _routing(r, plan, example)
    lines += _cost_lines(cost, plan.symbols, example, indent="  ")
    if kernels:
        k = kernels.get(r.name)
        text = k.describe().rstrip() if k is not None else "(no kernel)"
        lines.append("  kernel: " + text.replace("\n", "\n    "))
    return lines


def _routing(r, plan: DispatchPlan, example) -> list[str]:
    """A kiln::moe_experts(_fp8) op's data-dependent sizes (tokens per expert) with the bound
    they carry by construction: an expert has at most all N * k (token, expert) pairs,
    the size of the row buffer the pairs are sorted into."""
    lines = []
    for op in r.ops:
        if op.target not in MOE_OPS:
            continue
        ids, gate = op.args[2], op.args[3]
        shape = {o.name: o.shape for o in r.ops}
        tokens, top_k = (plan.values[ids.name].shape if ids.name in plan.values
                         else shape[ids.name])
        experts = (plan.values[gate.name].shape if gate.name in plan.values
                   else shape[gate.name])[0]
        pairs = routing_bound(tokens, top_k)
        size = _bounded(pairs, plan.symbols, example)
        lines.append(f"  routing: {experts} experts, k = {top_k}; rows per expert <= N*k = "
                     f"{size}, the row buffer's size")
    return lines


def _bounded(expr: Dim, symbols, example) -> str:
    """A size as its formula with its values at the example and at the upper bounds."""
    if isinstance(expr, int) or not expr.free_symbols:
        return str(int(expr))
    at = [f"{evaluate(expr, example)} at example"] if example else []
    hi = bounds_of(expr, symbols).hi
    at.append(f"{hi} at max" if hi is not None else "unbounded at max")
    return f"{to_str(sympy.expand(expr))} ({', '.join(at)})"


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


def _weight_bytes(plan: DispatchPlan) -> int:
    return sum(evaluate(v.numel, {}) * v.itemsize for v in plan.values.values()
               if v.role in (Role.WEIGHT, Role.STATE) and all(isinstance(d, int) for d in v.shape))


def _weights(plan: DispatchPlan) -> list[str]:
    weights = [v for v in plan.values.values() if v.role in (Role.WEIGHT, Role.STATE)]
    state = sum(1 for v in weights if v.role == Role.STATE)
    return [f"weights: {len(weights)} tensors ({state} updated in place), "
            f"{human_bytes(_weight_bytes(plan))}"]


def explain_devices(parts) -> str:
    """Every rank of a multi-device plan, one after another: its regions, weights,
    collectives and transfers. `parts` holds (program, example sizes, ParallelConfig)
    per rank, in rank order."""
    first, _, cfg = parts[0]
    total = 0
    out = [f"kiln explain: a tp={cfg.tp} x pp={cfg.pp} plan for {first.kplan.target}, "
           f"{len(parts)} devices (a rank each)"]
    out += _symbols(first.plan.symbols, _full_env(first.plan, parts[0][1] or {}),
                    first.plan.dim_names)
    for program, sizes, parallel in parts:
        example = _full_env(program.plan, sizes or {})
        out.append("")
        out += _device(program.plan, parallel, example)
        out += ["  " + line for line in _stage_io(program.plan, example)] or \
            ["  transfers: none (no pipeline stage boundary)"]
        total += _weight_bytes(program.plan)
    out += ["", f"weights on all {len(parts)} devices: {human_bytes(total)}"]
    return "\n".join(out) + "\n"


def _device(plan: DispatchPlan, parallel, example) -> list[str]:
    """This rank's share of a multi-device plan: its regions, weights and collectives."""
    kinds = Counter(r.kind.value for r in plan.regions)
    lines = [f"device: rank {parallel.rank} of tp={parallel.tp} x pp={parallel.pp} "
             f"(tp rank {parallel.tp_rank}, pipeline stage {parallel.pp_rank})",
             f"  regions: {len(plan.regions)} ("
             + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")",
             "  " + _weights(plan)[0]]
    colls = [(i, r) for i, r in enumerate(plan.regions)
             if r.kind.value == "extern" and r.anchor().target.startswith("kiln.all_")]
    rows, per_kind = [], Counter()
    for i, r in colls:
        op = r.anchor()
        v = plan.values[r.outputs[0]]
        kind = op.target.split(".")[1]
        n = evaluate(v.numel, example) * v.itemsize if example is not None else None
        per_kind[kind] += n or 0
        nbytes = human_bytes(n) if n is not None else to_str(v.numel) + " elements"
        where = f" at {_short_where(op.where)}" if op.where else ""
        rows.append(f"    #{i} {r.name}: {kind} on {op.args[-1]!r}, "
                    f"{type_str(v.shape, v.dtype)}, {nbytes}{where}")
    kinds = Counter(r.anchor().target.split(".")[1] for _, r in colls)
    known = example is not None
    summary = ", ".join(f"{kinds[k]} {k}" + (f" {human_bytes(per_kind[k])}" if known else "")
                        for k in sorted(kinds))
    lines.append(f"  collectives: {len(colls)}" + (f" ({summary} per call; in schedule "
                                                    "order:)" if colls else ""))
    return lines + rows


def _stage_io(plan: DispatchPlan, example) -> list[str]:
    """A pipeline stage's boundary: what it receives before a call and sends after."""
    if not plan.recv and not plan.send:
        return []
    lines = ["transfers at the pipeline stage boundary (per call, in order):"]
    moves = [("recv", n, f"from stage {src}") for n, src in plan.recv]
    moves += [("send", n, "to stage" + ("s " if len(d) > 1 else " ") + ", ".join(map(str, d)))
              for n, d in plan.send]
    for kind, name, peer in moves:
        v = plan.values[name]
        size = _at(v.numel * v.itemsize, plan.symbols, example, human_bytes)
        lines.append(f"  {kind} %{name} {type_str(v.shape, v.dtype)} {peer}: {size}")
    return lines


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
