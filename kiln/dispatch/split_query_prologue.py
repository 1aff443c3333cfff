"""A prefill attention's query prologue (RoPE, a q norm) as a region of its own.

Region formation fuses the ops computing the query into the attention region, so the
kernel computes them where it loads its q tile. For a decode tile (16 rows at most)
that saves a launch and a round trip through memory. For a prefill tile (128 rows) it
holds the prologue's operands in registers beside the key loop's: on an H200 at
Llama-3-8B's widths, prefill 2048, kiln's attention reading q through its RoPE took
144.3 us against 122.1 us reading a plain q (sm_90: 255 registers against 231), where
RoPE alone is one pass over q (16 MB in and out at 2048 tokens, a few microseconds).
So an attention region whose query length may exceed DECODE_ROWS takes its query
from a pointwise region placed before it (dispatch/split.py's split_prologue); a
prologue of one op (a cast, a scale) stays: it adds nothing to hold.

Only targets that generate kernels (the CPU target runs SDPA as torch's op).
"""

from __future__ import annotations

import logging

from kiln.dispatch.split import materialisation_point, split_prologue
from kiln.ir.ops import SDPA_FORMS, OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Ref, Region, RegionKind
from kiln.ir.symbolic import bounds_of
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

DECODE_ROWS = 16  # the attention template's decode tile: up to this many query rows
_NOT_COMPUTE = {OpCategory.VIEW, OpCategory.CREATE, OpCategory.TUPLE}


def _prologue_ops(region: Region, query: str) -> int:
    """How many compute ops of `region` the query depends on."""
    by_name = {o.name: o for o in region.ops}
    seen, stack, n = set(), [query], 0
    while stack:
        name = stack.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        op = by_name[name]
        n += op.target != "getitem" and category(op.target) not in _NOT_COMPUTE
        stack.extend(op.refs())
    return n


def query_to_split(region: Region, plan: DispatchPlan) -> str | None:
    """The attention region's query operand when its prologue should be a region of its
    own: a prefill (query length may exceed DECODE_ROWS) with more than one compute op
    behind the query. None otherwise."""
    if region.kind != RegionKind.ATTENTION:
        return None
    anchor = region.anchor()
    if anchor.target not in SDPA_FORMS:
        return None
    q = bind_args(anchor).get("query")
    if not isinstance(q, Ref) or materialisation_point(region, q) is None:
        return None
    shape = region.op(q.name).shape
    if shape is None or len(shape) < 2:
        return None
    rows = bounds_of(shape[-2], plan.symbols).hi
    if rows is not None and rows <= DECODE_ROWS:
        return None
    return q.name if _prologue_ops(region, q.name) > 1 else None


@as_pass
def split_query_prologue(plan: DispatchPlan, ctx) -> DispatchPlan:
    if not ctx.target.uses_triton or not ctx.options.get("query_prologue_split", True):
        return plan
    for region in list(plan.regions):
        query = query_to_split(region, plan)
        if query is not None:
            split_prologue(plan, region, query,
                           f"a prefill tile (query rows > {DECODE_ROWS}) reads a plain q")
    return plan
