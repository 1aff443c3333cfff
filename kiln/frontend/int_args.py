"""Python int arguments made dynamic: size symbols bound from the argument at call time.

Why: Meta's Llama passes `start_pos: int` and slices its cache and RoPE table with it;
torch.export makes such an int a SymInt placeholder (prefill and decode one program).
torch 2.13 takes only Dim.DYNAMIC / Dim.AUTO for an int, so a named Dim (with the
min / max kiln checks calls against) is handed to torch as Dim.DYNAMIC and its name
and bounds kept here. torch accepts any guard on such a symbol without asking (a
slice `cache[start:start + seq]` assumes start + seq <= the cache's length); the
guards that decide sizes are kept as checks run on every call (`size_checks`), the
ones about strides dropped: kiln's values are contiguous whatever the sizes.
"""

from __future__ import annotations

import inspect
import sys

import sympy
import torch
import torch.utils._pytree as pytree
from torch.export.dynamic_shapes import Dim as _NamedDim

from kiln.ir.symbolic import Bounds, bounds_of


class _Leaf:
    """A flattened argument with its index, so a walk over dynamic_shapes knows it."""

    def __init__(self, index: int, value):
        self.index, self.value = index, value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _marked(args: tuple, kwargs: dict):
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    return pytree.tree_unflatten([_Leaf(i, v) for i, v in enumerate(leaves)], spec)


def _pairs(model, args, kwargs, dynamic_shapes) -> list[tuple[object, object, object]]:
    """(argument, its spec, a setter writing a new spec) for each top-level argument."""
    if isinstance(dynamic_shapes, dict):
        try:
            bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
        except (TypeError, ValueError):
            return []
        return [(bound[k], s, k) for k, s in dynamic_shapes.items() if k in bound]
    if isinstance(dynamic_shapes, (list, tuple)):
        values = [*args, *kwargs.values()]
        return [(v, s, i) for i, (v, s) in enumerate(zip(values, dynamic_shapes))]
    return []


def _rewrite(value, spec, found: dict[int, object]):
    """`spec` with each int leaf's Dim recorded in `found` (flat index -> Dim) and a
    named Dim replaced by Dim.DYNAMIC, the only form torch takes for an int."""
    if isinstance(value, _Leaf):
        if _is_int(value.value) and spec is not None and not isinstance(spec, (dict, list,
                                                                               tuple)):
            found[value.index] = spec
            return torch.export.Dim.DYNAMIC if isinstance(spec, _NamedDim) else spec
        return spec
    if isinstance(value, (list, tuple)) and isinstance(spec, (list, tuple)):
        return type(spec)([_rewrite(v, s, found) for v, s in zip(value, spec)]
                          + list(spec[len(value):]))
    if isinstance(value, dict) and isinstance(spec, dict):
        return {k: _rewrite(value.get(k), s, found) for k, s in spec.items()}
    return spec


def int_dims(model, args: tuple, kwargs: dict, dynamic_shapes):
    """(dynamic_shapes as torch.export takes them, {flat argument index: the Dim the
    user gave that int argument})."""
    found: dict[int, object] = {}
    if dynamic_shapes is None:
        return dynamic_shapes, found
    margs, mkwargs = _marked(args, kwargs)
    pairs = _pairs(model, margs, mkwargs, dynamic_shapes)
    if isinstance(dynamic_shapes, dict):
        out = dict(dynamic_shapes)
        for value, spec, key in pairs:
            out[key] = _rewrite(value, spec, found)
        return out, found
    if isinstance(dynamic_shapes, (list, tuple)):
        out = list(dynamic_shapes)
        for value, spec, i in pairs:
            out[i] = _rewrite(value, spec, found)
        return type(dynamic_shapes)(out), found
    return dynamic_shapes, found


def declared_bounds(dim, exported: Bounds | None) -> Bounds | None:
    """A named Dim's own bounds (its max, else torch's); Dim.DYNAMIC / AUTO: torch's.
    torch's upper bound for an int comes from tracing with every dynamic tensor dim at
    least 2 (start <= 14 for a cache of 16), so a Dim's max wins: the size checks keep
    the calls sound."""
    if not isinstance(dim, _NamedDim):
        return exported
    hi = dim.max if isinstance(dim.max, int) and dim.max < sys.maxsize - 1 else None
    if hi is None and exported is not None:
        hi = exported.hi
    return Bounds(int(dim.min), hi)


_RELATIONS = {sympy.Le: "<=", sympy.Lt: "<", sympy.Ge: ">=", sympy.Gt: ">",
              sympy.Eq: "==", sympy.Ne: "!="}


def captured_guards(ep: torch.export.ExportedProgram) -> list:
    """The guards torch took while capturing `ep`, before decomposition re-traces it.
    With int size inputs, the program's own input guards (`_guards_code`, which the
    re-trace would assert and refine the symbols' ranges by) are dropped: they include
    the stride guards (start_pos != 1 for a [seq, start_pos] zeros) kiln does not need,
    and kiln checks every call against the ones it keeps."""
    env = _shape_env(ep)
    if env is None:
        return []
    if any(_is_int_input(n) for n in ep.graph.nodes) and hasattr(ep, "_guards_code"):
        ep._guards_code = []
    return list(env.guards)


def _is_int_input(node) -> bool:
    expr = getattr(getattr(node.meta.get("val"), "node", None), "expr", None)
    return node.op == "placeholder" and isinstance(node.meta.get("val"), torch.SymInt) \
        and isinstance(expr, sympy.Symbol)


def size_checks(guards: list, int_symbols: set[str],
                symbols: dict[str, Bounds]) -> list[tuple[sympy.Expr, str, str]]:
    """torch's guards over the int arguments' symbols that their bounds do not imply,
    each as (lhs - rhs, relation, the guard's text): e.g. (s27 + s30 - 16, "<=")."""
    if not int_symbols:
        return []
    checks: list[tuple[sympy.Expr, str, str]] = []
    for guard in guards:
        loc = guard.sloc.framework_loc
        filename = getattr(loc, "filename", "") or ""
        if "_prims_common" in filename.replace("\\", "/"):
            continue  # strides and contiguity: kiln's values are row-major whatever
        expr = guard.expr
        if not {s.name for s in expr.free_symbols} & int_symbols:
            continue
        parts = expr.args if isinstance(expr, sympy.And) else (expr,)
        for part in parts:
            rel = _RELATIONS.get(type(part))
            if rel is None:
                continue
            diff = sympy.expand(part.lhs - part.rhs)
            if not _implied(diff, rel, symbols):
                checks.append((diff, rel, str(part)))
    return list({(str(d), r): (d, r, t) for d, r, t in checks}.values())


def _implied(diff, rel: str, symbols: dict[str, Bounds]) -> bool:
    if diff.is_Integer:
        return True  # torch decided it at trace time for every value
    b = bounds_of(diff, symbols)
    if rel in ("<=", "<"):
        return b.hi is not None and (b.hi <= 0 if rel == "<=" else b.hi < 0)
    if rel in (">=", ">"):
        return b.lo >= 0 if rel == ">=" else b.lo > 0
    return False


def _shape_env(ep: torch.export.ExportedProgram):
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        env = getattr(getattr(val, "node", None), "shape_env", None) or \
            getattr(getattr(val, "fake_mode", None), "shape_env", None)
        if env is not None:
            return env
    return None
