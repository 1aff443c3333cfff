"""What a reshape does to the dims: collapse (merge), expand (split), both, or nothing.

Shared by the collapse-dimensions pass and the verifier that forbids the
collapse -> expand -> collapse round trip behind DESIGN.md's failure 1.
"""

from __future__ import annotations

import sympy
import torch.fx as fx

from kiln.ir.graph import shape_of
from kiln.ir.ops import op_name

RESHAPES = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"}


def is_reshape(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and op_name(node.target) in RESHAPES)


def _eq(a, b) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def groups(src, dst) -> list[tuple[list[int], list[int]]] | None:
    """Pair up runs of src dims and dst dims with equal products (None if not matchable).

    [2, 3, 4] -> [6, 4] gives [([0, 1], [0]), ([2], [1])]. Unit dims join a neighbour.
    """
    src = [d for d in src]
    dst = [d for d in dst]
    out: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj = [], []
        pi, pj = 1, 1
        if i < len(src):
            gi.append(i)
            pi = src[i]
            i += 1
        if j < len(dst):
            gj.append(j)
            pj = dst[j]
            j += 1
        guard = 0
        while not _eq(pi, pj):
            guard += 1
            if guard > 64:
                return None
            grow_src = _smaller(pi, pj)
            if grow_src and i < len(src):
                gi.append(i)
                pi = pi * src[i]
                i += 1
            elif j < len(dst):
                gj.append(j)
                pj = pj * dst[j]
                j += 1
            elif i < len(src):
                gi.append(i)
                pi = pi * src[i]
                i += 1
            else:
                return None
        out.append((gi, gj))
    return out


def _smaller(a, b) -> bool:
    """Is a < b, deciding symbolic cases by the ratio (a divides b)?"""
    if isinstance(a, int) and isinstance(b, int):
        return a < b
    ratio = sympy.simplify(sympy.sympify(b) / sympy.sympify(a))
    if ratio.is_Integer:
        return ratio > 1
    if ratio.is_Rational:
        return ratio > 1
    return len(str(a)) < len(str(b))


def kind(src, dst) -> str:
    """'identity', 'collapse' (only merges), 'expand' (only splits), or 'mixed'."""
    g = groups(src, dst)
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
    return "identity"


def node_kind(node: fx.Node) -> str:
    return kind(shape_of(node.args[0]), shape_of(node))


def round_trips(graph: fx.Graph) -> list[str]:
    """Every collapse -> expand -> collapse chain of reshapes, described for an error."""
    found = []
    for n in graph.nodes:
        if not (is_reshape(n) and is_reshape(n.args[0]) and is_reshape(n.args[0].args[0])):
            continue
        mid, first = n.args[0], n.args[0].args[0]
        ks = (node_kind(first), node_kind(mid), node_kind(n))
        if ks[0] in ("collapse", "mixed") and ks[1] in ("expand", "mixed") and ks[2] in (
            "collapse", "mixed"
        ):
            found.append(
                f"collapse -> expand -> collapse round trip %{first.name} -> %{mid.name} -> "
                f"%{n.name}"
            )
    return found
