"""Collapse dimensions: every chain of reshapes becomes one reshape, or none.

A reshape of a reshape (view, _unsafe_view, reshape, unsqueeze, squeeze: ops that
only re-shape row-major data) is the single reshape from the chain's source to the
chain's final shape; a reshape to the source's own shape disappears. So no reshape
reads a reshape, and no collapse -> expand -> collapse round trip can remain: the
pattern behind DESIGN.md's failure 1, where a fused attention's index maps went
through one and needed 4x the shared memory the target had.

Establishes `no-reshape-chains` and `no-reshape-round-trip`. Assumes canonical views
(canonicalize ran: no tuple-splitting ops feed reshapes).
"""

from __future__ import annotations

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.rewrite import erase_if_dead, replace, reshape_to, same_shape
from kiln.ir.graph import KilnGraph
from kiln.ir.reshape import is_reshape
from kiln.pipeline import as_pass


def collapse_chains(kg: KilnGraph) -> int:
    """Compose reshape chains front to back: each reshape's source is already composed."""
    changed = 0
    for node in list(kg.graph.nodes):
        if not is_reshape(node) or node._erased:
            continue
        src = node.args[0]
        if not is_reshape(src):
            if same_shape(src, node):
                replace(node, src)
                changed += 1
            continue
        root = src.args[0]
        new = root if same_shape(root, node) else reshape_to(kg, root, node)
        if new is None:
            continue
        replace(node, new)
        erase_if_dead(src)
        changed += 1
    return changed


@as_pass(establishes=("no-reshape-chains", "no-reshape-round-trip"))
def collapse_dims(kg: KilnGraph, ctx) -> KilnGraph:
    if collapse_chains(kg):
        eliminate_dead_code(kg)
        kg.recompile()
    return kg
