"""Dead-code elimination: drop every op whose value nothing reads.

Establishes `no-dead-code`. Assumes the graph is functional (core ATen after export):
buffer updates are outputs, so no op has a side effect that DCE could lose.
"""

from __future__ import annotations

from kiln.ir.graph import KilnGraph
from kiln.pipeline import as_pass


def eliminate_dead_code(kg: KilnGraph) -> int:
    removed = 0
    for node in reversed(list(kg.graph.nodes)):
        if node.op == "call_function" and not node.users:
            kg.graph.erase_node(node)
            removed += 1
    return removed


@as_pass(establishes=("no-dead-code",))
def dce(kg: KilnGraph, ctx) -> KilnGraph:
    if eliminate_dead_code(kg):
        kg.recompile()
    return kg
