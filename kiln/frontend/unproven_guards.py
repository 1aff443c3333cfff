"""A model torch.export refused for a guard that holds on every declared size.

Why: torch.export refuses a named Dim when the model's trace adds a guard its solver
cannot prove over the Dim's range, even when the guard is true for every size in it.
torch 2.11 computes the stride of repeat_kv's reshape (every transformers GQA model's
attention) as `Min(128*T, 256*T)` and then cannot show `Min(128*T, 256*T) == 128*T`,
so a transformers Llama without a cache did not export at a dynamic length (torch 2.13
simplifies it; `Max(T, 2*T - 1) == 2*T - 1` is one it still cannot). Export again with
such guards kept as runtime asserts, and take that program only when kiln proves every
assert over the declared ranges; otherwise torch's refusal stands.
"""

from __future__ import annotations

import itertools
import math

import sympy
import torch
import torch.fx as fx
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

# sizes enumerated to prove a guard by trying every value (a product over its symbols)
_MOST_TRIED = 4096


def refused_for_a_guard(text: str) -> bool:
    """Whether torch's export error is its solver refusing a declared Dim's range."""
    return "Constraints violated" in text and "satisfy the generated guard" in text


def export_if_guards_hold(export_deferred):
    """The program `export_deferred()` gives (torch.export with
    prefer_deferred_runtime_asserts_over_guards=True) when each of its runtime asserts
    holds for every size in range; else None."""
    try:
        ep = export_deferred()
    except Exception:  # noqa: BLE001 - any failure here: torch's first refusal stands
        return None
    ranges = dict(ep.range_constraints)
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten._assert_scalar.default \
                and not holds(_asserted(node), ranges):
            return None
    return ep


def _asserted(node: fx.Node):
    """The sympy condition an _assert_scalar node asserts (None where none is known)."""
    cond = node.args[0]
    if isinstance(cond, bool):
        return sympy.true if cond else sympy.false
    val = cond.meta.get("val") if isinstance(cond, fx.Node) else None
    if isinstance(val, bool):
        return sympy.true if val else sympy.false
    return getattr(getattr(val, "node", None), "expr", None)


def holds(expr, ranges: dict[sympy.Symbol, ValueRanges]) -> bool:
    """Whether `expr` is true for every assignment of its symbols within `ranges`:
    torch's interval bound, then sympy with each symbol written as its lower bound plus
    a non-negative integer, then every value where there are few."""
    if expr is None:
        return False
    if expr in (sympy.true, True):
        return True
    free = sorted(expr.free_symbols, key=str)
    if any(s not in ranges or not _finite(ranges[s]) for s in free):
        return False
    try:
        if bound_sympy(expr, {s: ranges[s] for s in free}) == ValueRanges(True, True):
            return True
    except Exception:  # noqa: BLE001 - torch's bound does not take every function
        pass
    shifted = _as_sympy(expr).xreplace({
        s: int(ranges[s].lower) + sympy.Symbol(f"{s}_over", integer=True, nonnegative=True)
        for s in free})
    if shifted in (sympy.true, True) or _true_by_sign(shifted):
        return True
    return _every_value(expr, free, ranges)


def _as_sympy(expr):
    """torch's own Min / Max (torch.utils._sympy.functions) as sympy's, which simplify
    by their arguments' signs."""
    own = {"Min": sympy.Min, "Max": sympy.Max}
    return expr.replace(lambda e: isinstance(e, sympy.Basic) and not isinstance(
        e, (sympy.Min, sympy.Max)) and type(e).__name__ in own,
                        lambda e: own[type(e).__name__](*e.args))


def _true_by_sign(rel) -> bool:
    """A comparison of polynomials in non-negative symbols, true by the sign of its
    expanded difference (sympy's own simplification otherwise)."""
    if isinstance(rel, sympy.Rel):
        diff = sympy.expand(sympy.simplify(rel.lhs - rel.rhs))
        sign = {sympy.Eq: diff == 0, sympy.Ne: diff.is_positive or diff.is_negative,
                sympy.Ge: diff.is_nonnegative, sympy.Gt: diff.is_positive,
                sympy.Le: (-diff).is_nonnegative, sympy.Lt: (-diff).is_positive}
        if sign.get(type(rel)):
            return True
    return sympy.simplify(rel) in (sympy.true, True)


def _finite(vr: ValueRanges) -> bool:
    return all(isinstance(b, (int, sympy.Integer)) for b in (vr.lower, vr.upper))


def _every_value(expr, free: list[sympy.Symbol], ranges) -> bool:
    spans = [range(int(ranges[s].lower), int(ranges[s].upper) + 1) for s in free]
    if math.prod(len(r) for r in spans) > _MOST_TRIED:
        return False
    for values in itertools.product(*spans):
        if expr.xreplace(dict(zip(free, map(sympy.Integer, values)))) not in (sympy.true, True):
            return False
    return True
