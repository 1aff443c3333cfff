"""An SDPA whose boolean mask is provably `key <= query` runs with is_causal instead.

transformers 5 builds a prompt's mask from positions even without a cache:
position_ids = arange(T), the causal term `kv_idx <= q_idx` read through index ops,
and-ed with a packed-sequence term (ids from a cumsum of `diff(position_ids) != 1`,
equal for the query and the key). Over aranges those ids are all 0 and the mask is
torch's is_causal. Read as a mask tensor it cost a torch cumsum region, the envelope's
reduction kernel, and the attention kernel's mask loops: on sm_90 (Triton 3.6) an 8B
prefill attention held 255 registers and spilled 54 words with them, 192 without.

The mask's value is followed as a formula in its element's index (index_forms.py;
a constant tril buffer sliced to the prompt, nanoGPT's slow path, reads as one too);
when it is exactly `x0 <= x1` (key index at most query index over the last two dims,
the same for every batch and head) the SDPA drops the mask and sets is_causal, which
torch defines as that mask (top-left aligned). An additive mask where(keep, 0, fill)
of a fill that drowns any score (transformers' eager masks, finfo.min) counts as its
`keep`: a causal mask leaves every row a key, so the two agree. Anything the forms
cannot follow keeps its mask. kiln.ops.softcap_attention (Gemma 2's global layers)
takes is_causal the same way. A mask that is not causal (a sliding window) still loses
the terms its aranges prove all true (the packed-sequence ids). The mask's ops are left
to dce.
"""

from __future__ import annotations

import logging

import sympy
import torch
import torch.fx as fx

from kiln.graph.eager_attention import HUGE_FILL
from kiln.graph.fold_constants import constant_placeholders, note_values_read
from kiln.graph.index_forms import IndexForms, X
from kiln.graph.rewrite import name_of, same_shape
from kiln.ir.graph import KilnGraph
from kiln.ir.ops import SOFTCAP_ATTENTION, bind_args
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.graph")

SDPA = "aten.scaled_dot_product_attention.default"
_AND = ("aten.bitwise_and.Tensor", "aten.logical_and.default")


def is_key_le_query(form) -> bool:
    """Whether a mask form is `x0 <= x1` (a relation over the last two dims' indices)."""
    if not isinstance(form, sympy.core.relational.Relational):
        return False
    if not form.free_symbols <= {X[0], X[1]}:
        return False
    lhs, rhs = form.lhs, form.rhs
    if isinstance(form, (sympy.Le, sympy.Lt)):
        diff = lhs - rhs + (1 if isinstance(form, sympy.Lt) else 0)
    elif isinstance(form, (sympy.Ge, sympy.Gt)):
        diff = rhs - lhs + (1 if isinstance(form, sympy.Gt) else 0)
    else:
        return False
    return sympy.expand(diff - (X[0] - X[1])) == 0  # integers: a < b is a + 1 <= b


_WHERES = ("aten.where.self", "aten.where.Scalar", "aten.where.ScalarSelf",
           "aten.where.ScalarOther")


def _number(node, consts: dict, read: set | None = None):
    """The value of a scalar: a Python number, a full of [] / scalar_tensor, a lifted
    0-d constant (added to `read`); None otherwise."""
    if isinstance(node, (int, float)):
        return node
    if not isinstance(node, fx.Node):
        return None
    if name_of(node) == "aten.full.default" and list(node.args[0]) == []:
        return node.args[1]
    if name_of(node) == "aten.scalar_tensor.default":
        return node.args[0]
    t = consts.get(node)
    if not (isinstance(t, torch.Tensor) and t.numel() == 1):
        return None
    if read is not None:
        read.add(node)
    return t.item()


def mask_condition(mask: fx.Node, consts: dict, read: set | None = None) -> fx.Node | None:
    """The boolean tensor saying which keys a mask keeps: the mask itself, or for an
    additive mask where(keep, 0, fill) with a fill that drowns any score (transformers'
    eager masks: finfo.min; -inf) its `keep`. None for any other mask."""
    while name_of(mask) == "aten._to_copy.default":
        mask = mask.args[0]
    if mask.meta["val"].dtype == torch.bool:
        return mask
    if name_of(mask) not in _WHERES:
        return None
    keep, zero, fill = mask.args
    zero, fill = _number(zero, consts, read), _number(fill, consts, read)
    if zero != 0 or fill is None or not fill <= -HUGE_FILL:
        return None
    return keep


def drop_true_terms(keep: fx.Node, forms: IndexForms) -> int:
    """Drop the and-ed terms of a mask that its aranges prove all true (transformers'
    packed-sequence ids over aranges, beside a sliding window that is not causal): the
    cumsum's torch region and the ops the attention's prologue computes go with them.
    Only where the other term has the and's own shape and dtype (no broadcast lost)."""
    dropped, stack, seen = 0, [keep], set()
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen or name_of(node) not in _AND:
            continue
        seen.add(node)
        x, y = node.args[:2]
        for term, other in ((x, y), (y, x)):
            if (forms.of(term) is sympy.true and isinstance(other, fx.Node)
                    and same_shape(other, node)
                    and other.meta["val"].dtype == node.meta["val"].dtype):
                node.replace_all_uses_with(other)
                dropped += 1
                stack.append(other)
                break
        else:
            stack.extend((x, y))
    return dropped


@as_pass
def causal_sdpa(kg: KilnGraph, ctx) -> KilnGraph:
    consts = constant_placeholders(kg)
    forms = IndexForms(consts)
    causal = dropped = 0
    for node in list(kg.graph.nodes):
        if name_of(node) not in (SDPA, SOFTCAP_ATTENTION):
            continue
        b = bind_args(node)
        mask = b.get("attn_mask")
        if mask is None or b.get("is_causal") or b.get("dropout_p", 0.0) != 0.0:
            continue
        keep = mask_condition(mask, consts, forms.read)
        if keep is None:
            continue
        if is_key_le_query(forms.of(keep)):
            kwargs = {k: v for k, v in b.items() if k not in ("query", "key", "value")}
            kwargs.update(attn_mask=None, is_causal=True)
            node.args = (b["query"], b["key"], b["value"])
            node.kwargs = kwargs
            causal += 1
        else:
            dropped += drop_true_terms(keep, forms)
    note_values_read(kg, forms.read)
    if causal or dropped:
        log.info("causal_sdpa: %d attention masks are key <= query (is_causal); %d mask "
                 "terms always true dropped", causal, dropped)
        kg.recompile()
    return kg
