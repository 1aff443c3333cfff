"""What a reshape does to the dims: collapse (merge), expand (split), both, or nothing.

Shared by the collapse-dimensions pass and the verifier that forbids the
collapse -> expand -> collapse round trip behind DESIGN.md's failure 1. A reshape
here is any op that changes only the shape of row-major data (`ops.SHAPE_ONLY_OPS`):
view, _unsafe_view, reshape, and unsqueeze / squeeze (which add or drop unit dims).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import sympy
import torch.fx as fx

from kiln.ir.graph import shape_of
from kiln.ir.ops import SHAPE_ONLY_OPS, op_name
from kiln.ir.symbolic import Bounds, as_dim, bounds_of, same_dim


def is_reshape(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and op_name(node.target) in SHAPE_ONLY_OPS)


def _is_unit(d) -> bool:
    return d == 1


def groups(src, dst, symbols: Mapping[str, Bounds] | None = None
           ) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of non-unit src and dst dims with equal products (None if unmatchable).

    [2, 3, 4] -> [6, 4] gives [([0, 1], [0]), ([2], [1])]. Unit dims move no data and
    appear in no group. Deciding which run to grow may need to compare symbolic sizes:
    that uses their ratio, then `symbols`' bounds; when neither decides, None.
    """
    si = [i for i, d in enumerate(src) if not _is_unit(d)]
    dj = [j for j, d in enumerate(dst) if not _is_unit(d)]
    out: list[tuple[list[int], list[int]]] = []
    a = b = 0
    while a < len(si) or b < len(dj):
        if a >= len(si) or b >= len(dj):
            return None
        gi, gj = [si[a]], [dj[b]]
        pi, pj = src[si[a]], dst[dj[b]]
        a, b = a + 1, b + 1
        while not same_dim(pi, pj):
            smaller = _smaller(pi, pj, symbols or {})
            if smaller is None:
                return None
            if smaller and a < len(si):
                gi.append(si[a])
                pi = pi * src[si[a]]
                a += 1
            elif not smaller and b < len(dj):
                gj.append(dj[b])
                pj = pj * dst[dj[b]]
                b += 1
            else:
                return None
        out.append((gi, gj))
    return out


def _smaller(a, b, symbols: Mapping[str, Bounds]) -> bool | None:
    """Should a's run grow to meet b (is a < b, or does a divide b)? Decided by their
    ratio, else by bounds; None when neither can tell."""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    ratio = _ratio(as_dim(a), as_dim(b))
    if ratio.is_Rational:
        return bool(ratio > 1)
    if ratio.is_integer and ratio.is_positive:  # a divides b: grow a's run to reach b
        return True
    if (1 / ratio).is_integer and (1 / ratio).is_positive:
        return False
    ba, bb = bounds_of(a, symbols), bounds_of(b, symbols)
    if ba.hi is not None and ba.hi < bb.lo:
        return True
    if bb.hi is not None and bb.hi < ba.lo:
        return False
    return None


@functools.lru_cache(maxsize=4096)
def _ratio(a, b):
    """b / a, simplified: the same few size pairs recur in every layer, and simplify
    costs milliseconds (the verifier asks after every pass)."""
    return sympy.simplify(sympy.sympify(b) / sympy.sympify(a))


def kind(src, dst, symbols: Mapping[str, Bounds] | None = None) -> str:
    """'identity' (same shape), 'unit' (only unit dims added or dropped), 'collapse'
    (only merges), 'expand' (only splits), or 'mixed' (both, or undecidable)."""
    if len(src) == len(dst) and all(same_dim(x, y) for x, y in zip(src, dst)):
        return "identity"
    g = groups(src, dst, symbols)
    if g is None:
        return "mixed"
    merges = any(len(a) > 1 and len(b) == 1 for a, b in g)
    splits = any(len(a) == 1 and len(b) > 1 for a, b in g)
    both = any(len(a) > 1 and len(b) > 1 for a, b in g)
    if both or (merges and splits):
        return "mixed"
    if merges:
        return "collapse"
    if splits:
        return "expand"
    return "unit"


def node_kind(node: fx.Node, symbols: Mapping[str, Bounds] | None = None) -> str:
    return kind(shape_of(node.args[0]), shape_of(node), symbols)


def _collapses(k: str) -> bool:
    return k in ("collapse", "mixed")


def _expands(k: str) -> bool:
    return k in ("expand", "mixed")


def round_trips(graph: fx.Graph, symbols: Mapping[str, Bounds] | None = None) -> list[str]:
    """Every collapse -> expand -> collapse along a chain of reshapes, described for an
    error. Reshapes that only add or drop unit dims (or change nothing) are looked
    through: they move no data, so a round trip through them is still one."""
    found = []
    for n in graph.nodes:
        if not is_reshape(n) or not _collapses(node_kind(n, symbols)):
            continue
        chain = [n]
        src = n.args[0]
        while is_reshape(src):
            chain.append(src)
            src = src.args[0]
        kinds = [node_kind(c, symbols) for c in chain]
        # chain runs backwards from n: find an expand, then a collapse before it.
        for i in range(1, len(chain)):
            if not _expands(kinds[i]):
                continue
            first = next((j for j in range(i + 1, len(chain)) if _collapses(kinds[j])), None)
            if first is not None:
                found.append(
                    f"collapse -> expand -> collapse round trip %{chain[first].name} -> "
                    f"%{chain[i].name} -> %{n.name}"
                )
                break
    return found
