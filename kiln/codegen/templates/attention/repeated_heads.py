"""Key and value heads repeated for the query heads (grouped-query attention written out).

gpt-fast's `k_cache.repeat_interleave(G, dim=1)` and transformers' `repeat_kv` (expand
then reshape) give SDPA as many key heads as query heads, head h being kv head h // G.
Read as H heads, every kv head's keys and values are loaded G times (on an H100 the
Llama-3-8B decode's attention read its static cache 4 times: ~13 of its ~20 us a
layer). Seen through the views, the template packs the G query heads of a kv head into
one tile, as it does for SDPA's own `enable_gqa`.
"""

from __future__ import annotations

from kiln.codegen.expr.indexing import Lin, Var
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.expr.views import is_view, source_index
from kiln.codegen.templates.op_operands import operand_shape
from kiln.ir.plan import DispatchPlan, Region


def repeated_heads(region: Region, plan: DispatchPlan, name: str, heads: int) -> int:
    """The largest G such that head h of [B, H, S, D] operand `name` reads the same
    elements as head (h // G) * G, seen back through its views; 1 if none."""
    shape = operand_shape(region, plan, name)
    if len(shape) != 4:
        return 1
    ops = {o.name: o for o in region.ops}
    for g in sorted((g for g in range(2, heads + 1) if heads % g == 0), reverse=True):
        head = Lin.of(Var("kvh", heads // g, block=False)) * g + Lin.of(Var("rep", g))
        index = (Lin.of(Var("b", shape[0], block=False)), head,
                 Lin.of(Var("n", shape[2])), Lin.of(Var("e", shape[3])))
        src = name
        try:
            while src in ops and is_view(ops[src], ops):
                src, index = source_index(ops[src], index,
                                          lambda n: operand_shape(region, plan, n), ops)
        except CodegenUnsupported:
            return 1
        if not any("rep" in Lin.of(i).var_names() for i in index):
            return g
    return 1
