"""Which dynamic dim deserves a second, narrower plan: the sizes where a plan's products
keep their GEMV form.

A product takes the GEMV form (and with it the folded norms, the grouped sibling
projections and the one-row decode attention's neighbours) only when its rows' upper
bound is at most gemv_max_rows(dtype): one row for 16-bit products, whose tiled
tensor-core form wins from two rows on. A decode module with a batch Dim up to 4, or
one module for prefill and decode over a sequence Dim (Meta's Llama code), is bounded
past that, so it runs tiled at every size, one row included: the 8B's decode step at one
row took 5.03 ms so against 4.04 ms as GEMVs (H200, benchmarks/RESULTS.md, thirty-eighth
session). kiln.compile therefore runs dispatch and codegen a second time with that dim
bounded to the sizes that keep the rows in the GEMV form, and the compiled module runs
that version at those sizes (runtime/program.py, `Program.narrow`).

The dim: a size symbol that alone sets the rows of most of the plan's products (c x s
rows, c a constant), with sizes both within the GEMV limit and past it. A symbol that
sets only a few products' rows (a prefill's logit positions: the LM head alone) is not
worth compiling the plan again for. Only targets that generate kernels have GEMVs to
gain; the CPU target runs torch's products either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from kiln.dispatch.fold_rmsnorm import FP8_GEMV_MAX_M, FP8_LINEAR
from kiln.dispatch.group_siblings import products
from kiln.ir.plan import DispatchPlan, RegionKind
from kiln.ir.symbolic import numel
from kiln.target import Target, gemv_max_rows

_TWO_D = {"aten.mm.default", "aten.addmm.default"}


@dataclass(frozen=True)
class NarrowBound:
    """Compile again with `symbols` in [lo, hi]: the sizes whose products stay GEMVs.
    Several symbols when torch gave one user Dim several (they are equal in every call:
    one is enough to choose the version by)."""

    symbols: tuple[str, ...]
    lo: int
    hi: int


def _rows_and_limit(op) -> tuple[object, int] | None:
    """A product's rows and the most rows its GEMV form takes; None for other products
    (batched bmm: their form does not turn on the rows alone)."""
    if op.target in _TWO_D:
        return op.shape[0], gemv_max_rows(op.dtype)
    if op.target == FP8_LINEAR:
        return numel(op.shape[:-1]), FP8_GEMV_MAX_M
    return None


def _per_symbol_limit(rows, limit: int) -> tuple[str, int] | None:
    """(s, the largest s keeping c x s rows within `limit`) for rows of one symbol."""
    if isinstance(rows, int) or len(rows.free_symbols) != 1:
        return None
    (s,) = rows.free_symbols
    c = sympy.simplify(rows / s)
    if not (c.is_Integer and c > 0):
        return None
    return s.name, limit // int(c)


def narrow_bound(plan: DispatchPlan, target: Target) -> NarrowBound | None:
    """The narrower bound worth a second plan for, or None (see the module docstring)."""
    if not target.uses_triton:
        return None
    total = 0
    limits: dict[str, list[int]] = {}
    for region in plan.regions:
        if region.kind not in (RegionKind.MATMUL, RegionKind.EXTERN):
            continue
        for op in products(region):
            rows = _rows_and_limit(op)
            if rows is None:
                continue
            total += 1
            found = _per_symbol_limit(*rows)
            if found is not None:
                limits.setdefault(found[0], []).append(found[1])
    by_dim: dict[str, list[int]] = {}  # a user Dim's symbols count together
    for name, per_product in limits.items():
        by_dim.setdefault(plan.dim_names.get(name, name), []).extend(per_product)
    best = max(by_dim.items(), key=lambda kv: len(kv[1]), default=None)
    if best is None or 2 * len(best[1]) <= total:
        return None
    dim, per_product = best
    names = tuple(sorted(n for n in plan.symbols if plan.dim_names.get(n, n) == dim))
    bounds = [plan.symbols[n] for n in names]
    if len(set(bounds)) != 1:
        return None  # not one dim after all
    hi = min(per_product)
    if hi < bounds[0].lo or (bounds[0].hi is not None and hi >= bounds[0].hi):
        return None  # no size is a GEMV's, or every size already is
    return NarrowBound(names, bounds[0].lo, hi)
