"""Common-subexpression elimination: one node per distinct pure computation.

Two call nodes are the same computation when they call the same op on the same
arguments: tensor arguments by node identity (a merged node's users then read the
survivor), size nodes by the symbolic size they compute, and Python constants by
type and value (1, 1.0 and True are different arguments). Export repeats
`view(x, ...)` for every projection and the same permutes per layer; merging them
lets later passes see one value.

Random and uninitialised ops (rand, dropout, empty) are never merged. Assumes a
functional graph: every other op's result depends only on its arguments.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kiln.graph.rewrite import is_sym, name_of
from kiln.ir.graph import KilnGraph
from kiln.ir.ops import IMPURE_OPS
from kiln.ir.symbolic import as_dim
from kiln.pipeline import as_pass


def _key(a):
    if isinstance(a, fx.Node):
        if is_sym(a):
            return ("sym", as_dim(a.meta["val"]))
        return ("node", a)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_key(x) for x in a))
    if isinstance(a, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in a.items())))
    if isinstance(a, torch.SymInt):
        return ("sym", as_dim(a))
    if isinstance(a, float) and a != a:
        return ("nan", id(a))  # NaN equals nothing, not even itself
    return (type(a).__name__, a)


def eliminate_common_subexpressions(kg: KilnGraph) -> int:
    seen: dict[tuple, fx.Node] = {}
    merged = 0
    for node in list(kg.graph.nodes):
        if node.op != "call_function" or name_of(node) in IMPURE_OPS:
            continue
        key = (node.target, _key(node.args), _key(dict(node.kwargs)))
        try:
            first = seen.setdefault(key, node)
        except TypeError:  # an argument Python cannot hash: leave the node alone
            continue
        if first is not node:
            node.replace_all_uses_with(first)
            kg.graph.erase_node(node)
            merged += 1
    return merged


@as_pass
def cse(kg: KilnGraph, ctx) -> KilnGraph:
    if eliminate_common_subexpressions(kg):
        kg.recompile()
    return kg
