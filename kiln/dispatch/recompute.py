"""Whether fusing a pointwise producer into a reduction that reads it broadcast would
recompute costly math many times over (a grouping rule, dispatch/grouping.py).

A region computes its prologue at every element of its anchor's domain. A producer
read through a broadcast is so computed once per element it is broadcast to: Qwen3-
Next's gathered experts read h = silu(g) * u [10, 512] in the down projection's sum
over [10, 2048, 512], so fused there it was 2048 sigmoids and divisions per element of
h (10 M a layer: 12.6 us on an H200 for a kernel whose 21 MB of weights stream in 5).
Stored once instead (in bf16: the widening cast after it stays fused), by the region
that computes g and u (a reduction's row epilogue), the down projection reads 10 KB
more and computes nothing.

Cheap ops (casts, adds, multiplies, selects, comparisons, gathers) are recomputed
freely: each is a few instructions next to the load it replaces, and keeping them
fused saves a launch (x.float() broadcast over every expert row stays in the products
that read it). The rule holds back a producer only when it is broadcast at least
BROADCAST_RECOMPUTE-fold, the reduction's domain holds at least RECOMPUTE_MIN_ELEMENTS
elements (a small broadcast costs less than a launch however often it is recomputed)
and some op that would come with it is costly (transcendental, division, power).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.fx as fx

from kiln.ir.graph import is_tensor_node, shape_of
from kiln.ir.ops import OpCategory, category, op_name
from kiln.ir.symbolic import Bounds, as_dim, numel, upper_bound

BROADCAST_RECOMPUTE = 32  # fold at which a costly producer is no longer fused
RECOMPUTE_MIN_ELEMENTS = 1 << 20  # ... and the consumer's domain at least this large

# pointwise ops as cheap as the load they would save (everything else is costly)
CHEAP = {f"aten.{n}" for n in (
    "add.Tensor", "add.Scalar", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "rsub.Tensor",
    "mul.Tensor", "mul.Scalar", "neg.default", "abs.default", "relu.default",
    "maximum.default", "minimum.default", "clamp.default", "clamp.Tensor",
    "clamp_min.default", "clamp_max.default", "where.self", "where.ScalarSelf",
    "where.ScalarOther", "masked_fill.Scalar", "masked_fill.Tensor", "eq.Tensor",
    "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor",
    "le.Scalar", "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar",
    "logical_and.default", "logical_or.default", "logical_not.default",
    "_to_copy.default", "clone.default", "copy.default", "alias.default",
    "detach.default", "lift_fresh_copy.default",
)}
_FUSED = {OpCategory.POINTWISE, OpCategory.GATHER, OpCategory.CONCAT}
_SEE_THROUGH = {OpCategory.VIEW, OpCategory.TUPLE}


def costly_broadcast(p: fx.Node, anchor: fx.Node, symbols: Mapping[str, Bounds]) -> bool:
    """Would fusing pointwise `p` into the region of reduction `anchor` (which computes
    its prologue at every element of its input) recompute costly math at least
    BROADCAST_RECOMPUTE times per element of p, over at least RECOMPUTE_MIN_ELEMENTS?
    A widening cast never is: recomputed, it costs nothing beside the load of its
    input, which this rule then stores (narrower) in its stead."""
    if not is_tensor_node(p) or not is_tensor_node(anchor.args[0]) or _widening_cast(p):
        return False
    own = numel(shape_of(p))
    domain = numel(shape_of(anchor.args[0]))
    fold = as_dim(domain / own) if own != 0 else 0
    if not isinstance(fold, int) or fold < BROADCAST_RECOMPUTE:
        return False
    hi = domain if isinstance(domain, int) else upper_bound(domain, symbols)
    return (hi is None or hi >= RECOMPUTE_MIN_ELEMENTS) and _costly(p)


def _widening_cast(p: fx.Node) -> bool:
    """A dtype cast of a tensor to a wider dtype (bf16 -> fp32)."""
    if op_name(p.target) != "aten._to_copy.default" or set(p.kwargs) - {"dtype"}:
        return False
    src = p.args[0]
    return (is_tensor_node(src) and src.meta["val"].dtype.itemsize
            < p.meta["val"].dtype.itemsize)


def _costly(p: fx.Node) -> bool:
    """Is any op of `p`'s private pointwise cone a costly one? The cone is what would
    fuse along with p: p, and each pointwise producer read by nothing outside the cone
    (a value others read too is stored by its own region, never recomputed here)."""
    cone = {p}
    frontier = _producers(p)
    changed = True
    while changed:
        changed = False
        for a in list(frontier):
            if a in cone or not _readers(a) <= cone:
                continue
            cone.add(a)
            frontier |= _producers(a)
            changed = True
    return any(category(op_name(n.target)) == OpCategory.POINTWISE
               and op_name(n.target) not in CHEAP for n in cone)


def _producers(n: fx.Node) -> set[fx.Node]:
    """The fusable compute nodes `n` reads, seen through views."""
    out, stack = set(), list(n.all_input_nodes)
    while stack:
        a = stack.pop()
        if a.op != "call_function":
            continue
        c = category(op_name(a.target))
        if c in _SEE_THROUGH:
            stack.extend(a.all_input_nodes)
        elif c in _FUSED:
            out.add(a)
    return out


def _readers(n: fx.Node) -> set[fx.Node]:
    """The nodes reading `n`, seen through views (the graph's output included)."""
    out, stack = set(), list(n.users)
    while stack:
        u = stack.pop()
        if u.op == "call_function" and category(op_name(u.target)) in _SEE_THROUGH:
            stack.extend(u.users)
        else:
            out.add(u)
    return out
