"""A prefill attention's operand prologues (RoPE, a q or k norm) as regions of their own.

Region formation fuses the ops computing q, k and v into the attention region, so the
kernel computes them where it loads its tiles. For a decode tile (16 rows at most)
that saves a launch and a round trip through memory. For a prefill tile (128 rows) it
costs twice over:
- the query's prologue holds its operands in registers beside the key loop's: on an
  H200 at Llama-3-8B's widths, prefill 2048, kiln's attention reading q through its
  RoPE took 144.3 us against 122.1 us reading a plain q (sm_90: 255 registers against
  231), where RoPE alone is one pass over q (16 MB in and out at 2048 tokens);
- the key's (and value's) prologue runs inside the key loop, once for every query tile
  that walks that key block: transformers' Llama without a cache (k's RoPE with cos
  and sin from inv_freq) at T 2048 recomputes each key block's RoPE for 64 query tiles
  a KV head, and the kernel spills 600 words on sm_90 where a plain k spills none.
So an attention region whose query length may exceed DECODE_ROWS takes each of q, k
and v from a region placed before it (dispatch/split.py's split_prologue) when its
prologue is more than one op. A one-op prologue (a cast, a scale) stays: it adds
nothing to hold; so does a key read through indices and casts (a paged cache's
gather): materialising it would copy the whole cache to save an address computation.

Only targets that generate kernels (the CPU target runs SDPA as torch's op).
"""

from __future__ import annotations

import logging

from kiln.dispatch.split import materialisation_point, split_prologue
from kiln.ir.ops import SDPA_FORMS, OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind
from kiln.ir.symbolic import bounds_of
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.dispatch")

DECODE_ROWS = 16  # the attention template's decode tile: up to this many query rows
OPERANDS = ("query", "key", "value")
_NOT_COMPUTE = {OpCategory.VIEW, OpCategory.CREATE, OpCategory.TUPLE}
_CASTS = {"aten._to_copy.default", "aten.to.dtype", "prims.convert_element_type.default"}


def _prologue(region: Region, operand: str) -> list[Op]:
    """The compute ops of `region` that `operand` depends on."""
    by_name = {o.name: o for o in region.ops}
    seen, stack, ops = set(), [operand], []
    while stack:
        name = stack.pop()
        if name in seen or name not in by_name:
            continue
        seen.add(name)
        op = by_name[name]
        if op.target != "getitem" and category(op.target) not in _NOT_COMPUTE:
            ops.append(op)
        stack.extend(op.refs())
    return ops


def _worth_a_region(role: str, ops: list[Op]) -> bool:
    if len(ops) <= 1:
        return False
    if role == "query":
        return True
    return not all(category(o.target) == OpCategory.GATHER or o.target in _CASTS for o in ops)


def _is_prefill(region: Region, plan: DispatchPlan, query: Ref) -> bool:
    """Whether the attention's query length may exceed DECODE_ROWS."""
    shape = region.op(query.name).shape if query.name not in region.inputs else \
        plan.values[query.name].shape
    if shape is None or len(shape) < 2:
        return False
    rows = bounds_of(shape[-2], plan.symbols).hi
    return rows is None or rows > DECODE_ROWS


def operands_to_split(region: Region, plan: DispatchPlan,
                      roles: tuple[str, ...] = OPERANDS) -> list[str]:
    """The attention region's operands (of `roles`) whose prologues should be regions of
    their own: in a prefill, each with a prologue worth one (`_worth_a_region`)."""
    if region.kind != RegionKind.ATTENTION:
        return []
    anchor = region.anchor()
    if anchor.target not in SDPA_FORMS:
        return []
    bound = bind_args(anchor)
    q = bound.get("query")
    if not isinstance(q, Ref) or not _is_prefill(region, plan, q):
        return []
    out = []
    for role in roles:
        arg = bound.get(role)
        if not isinstance(arg, Ref) or materialisation_point(region, arg) is None:
            continue
        if arg.name not in out and _worth_a_region(role, _prologue(region, arg.name)):
            out.append(arg.name)
    return out


def _roles(options) -> tuple[str, ...]:
    roles = ()
    if options.get("query_prologue_split", True):
        roles += ("query",)
    if options.get("key_prologue_split", True):
        roles += ("key", "value")
    return roles


@as_pass
def split_attention_prologues(plan: DispatchPlan, ctx) -> DispatchPlan:
    roles = _roles(ctx.options)
    if not ctx.target.uses_triton or not roles:
        return plan
    for region in list(plan.regions):
        for operand in operands_to_split(region, plan, roles):
            split_prologue(plan, region, operand,
                           f"a prefill tile (query rows > {DECODE_ROWS}) reads it plain")
    return plan
