"""Recognise the LLM building blocks and label their nodes: node.meta["kiln.pattern"].

Patterns (each matched from one anchor op, at any rank and sizes, with or without
the fp32 upcast around it, operands of commutative ops in either order):
- "attention": scaled_dot_product_attention, or the decomposed form
  matmul -> (scale, mask, casts) -> softmax -> (casts) -> matmul.
- "rmsnorm": x * rsqrt(mean(x^2) + eps) (also 1/sqrt, x/sqrt, x*x), then the
  optional cast back and multiply by a weight; not when x = a - mean(a) (LayerNorm).
- "rope": the rotate_half form x * cos + cat(-x2, x1) * sin, x1 / x2 the halves of x.
- "swiglu": silu(g) * u (silu or g * sigmoid(g)), with the projections producing g
  and u when they are matmuls.
Dispatch formation labels each region with its anchor's pattern, so plans and
`kiln explain` say what a region is. Labels are facts, not rewrites: the graph is
unchanged. A node keeps the first pattern that claims it (in the order above).

Assumes canonicalize ran (chunk is slices, transposes are permutes) and, for the
shapes it compares, collapse_dims (one reshape between two values at most).
"""

from __future__ import annotations

import logging

import torch.fx as fx

from kiln.graph.rewrite import (
    category_of,
    is_op,
    is_tensor,
    rank,
    scalar_arg,
    strip,
)
from kiln.ir.graph import KilnGraph, shape_of
from kiln.ir.ops import MATMULS, SDPA_FORMS, OpCategory, bind_args, norm_axis
from kiln.ir.symbolic import as_dim, same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.graph")

KEY = "kiln.pattern"
CAST = "aten._to_copy.default"
_VIEW_LIKE = ("aten.clone.default",)  # clone is a value-level no-op between views


def only_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def other_operand(node: fx.Node, x: fx.Node):
    """The operand of a binary op that is not `x` (None if `x` is not an operand)."""
    a, b = node.args[0], node.args[1]
    if a is x:
        return b
    if b is x:
        return a
    return None


def _through_casts(node: fx.Node, nodes: list[fx.Node]) -> fx.Node:
    """Follow single-user casts down from `node`, recording them; return the last."""
    while True:
        u = only_user(node)
        if not is_op(u, CAST):
            return node
        nodes.append(u)
        node = u


def _same_source(a, b) -> bool:
    """Are `a` and `b` the same value, up to casts (x and x.float())?"""
    return a is b or strip(a, CAST) is strip(b, CAST)


# ---- rmsnorm ------------------------------------------------------------------------


def _squared(node) -> fx.Node | None:
    if is_op(node, "aten.pow.Tensor_Scalar") and scalar_arg(node, 1) == 2:
        return node.args[0]
    if is_op(node, "aten.mul.Tensor") and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _centred(x: fx.Node) -> bool:
    """Is x = a - mean(a)? Then the norm around it is a LayerNorm, not an RMSNorm."""
    x = strip(x, CAST)
    return is_op(x, "aten.sub.Tensor") and is_op(x.args[1], "aten.mean.dim") and (
        x.args[1].args[0] is x.args[0])


def match_rmsnorm(mean: fx.Node) -> list[fx.Node] | None:
    if not is_op(mean, "aten.mean.dim"):
        return None
    x = _squared(mean.args[0])
    add = only_user(mean)
    if x is None or _centred(x) or not is_op(add, "aten.add.Tensor", "aten.add.Scalar") or (
        scalar_arg(add, 1) is None
    ):
        return None
    nodes = [mean.args[0], mean, add]
    root = only_user(add)
    if is_op(root, "aten.rsqrt.default"):
        nodes.append(root)
        normed = only_user(root)
        ok = is_op(normed, "aten.mul.Tensor") and _same_source(other_operand(normed, root), x)
    elif is_op(root, "aten.sqrt.default"):
        nodes.append(root)
        normed = only_user(root)
        if is_op(normed, "aten.reciprocal.default"):
            nodes.append(normed)
            recip, normed = normed, only_user(normed)
            ok = is_op(normed, "aten.mul.Tensor") and _same_source(
                other_operand(normed, recip), x)
        else:
            ok = (is_op(normed, "aten.div.Tensor") and normed.args[1] is root
                  and _same_source(normed.args[0], x))
    else:
        return None
    if not ok:
        return None
    nodes.append(normed)
    last = _through_casts(normed, nodes)
    scale = only_user(last)
    if is_op(scale, "aten.mul.Tensor") and is_tensor(other_operand(scale, last)):
        nodes.append(scale)
        _through_casts(scale, nodes)
    if is_op(x, CAST) and all(u in nodes for u in x.users):
        nodes.append(x)
    return nodes


# ---- rope -----------------------------------------------------------------------------


def _slice_of(node, x_dim: int) -> tuple[fx.Node, object, object] | None:
    """(source, start, length) of a slice along `x_dim` with step 1."""
    if not is_op(node, "aten.slice.Tensor"):
        return None
    a = bind_args(node)
    src = a["self"]
    dim = norm_axis(a["dim"], rank(src))
    if dim != x_dim or a["step"] != 1:
        return None
    start = a["start"]
    start = as_dim(start.meta["val"]) if isinstance(start, fx.Node) else (start or 0)
    return src, start, shape_of(node)[dim]


def match_rope(cat: fx.Node) -> list[fx.Node] | None:
    if not is_op(cat, "aten.cat.default") or len(cat.args[0]) != 2:
        return None
    d = norm_axis(bind_args(cat)["dim"], rank(cat))
    if d != rank(cat) - 1:
        return None
    neg, x1 = cat.args[0]
    if not is_op(neg, "aten.neg.default"):
        return None
    lo, hi = _slice_of(x1, d), _slice_of(neg.args[0], d)
    if lo is None or hi is None or lo[0] is not hi[0]:
        return None
    x = lo[0]
    half = lo[2]
    if not (lo[1] == 0 and same_dim(hi[1], half) and same_dim(hi[2], half)
            and same_dim(shape_of(x)[d], 2 * half)):
        return None
    rot_mul = only_user(cat)
    if not is_op(rot_mul, "aten.mul.Tensor"):
        return None
    add = only_user(rot_mul)
    if not is_op(add, "aten.add.Tensor"):
        return None
    x_mul = other_operand(add, rot_mul)
    if not is_op(x_mul, "aten.mul.Tensor") or not (
        _same_source(x_mul.args[0], x) or _same_source(x_mul.args[1], x)
    ):
        return None
    nodes = [x1, neg.args[0], neg, cat, rot_mul, x_mul, add]
    _through_casts(add, nodes)
    return nodes


# ---- swiglu ---------------------------------------------------------------------------


def _silu_input(node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(g, nodes) if `node` computes silu(g): silu.default or g * sigmoid(g)."""
    if is_op(node, "aten.silu.default"):
        return node.args[0], [node]
    if is_op(node, "aten.mul.Tensor"):
        for s in node.args[:2]:
            if is_op(s, "aten.sigmoid.default") and other_operand(node, s) is s.args[0]:
                return s.args[0], [s, node]
    return None


def _projection(value: fx.Node, claimed: list[fx.Node]) -> list[fx.Node]:
    """The matmul behind `value` (through casts and views) with the nodes between, if
    nothing outside `claimed` and that chain reads them."""
    chain = []
    n = value
    while category_of(n) == OpCategory.VIEW or is_op(n, CAST, *_VIEW_LIKE):
        chain.append(n)
        n = n.args[0]
    if not is_op(n, *MATMULS):
        return []
    inside = set(claimed) | set(chain)
    if all(u in inside for c in [*chain, n] for u in c.users):
        return chain + [n]
    return []


def match_swiglu(mul: fx.Node) -> list[fx.Node] | None:
    if not is_op(mul, "aten.mul.Tensor") or not all(is_tensor(a) for a in mul.args[:2]):
        return None
    for s, u in ((mul.args[0], mul.args[1]), (mul.args[1], mul.args[0])):
        silu = _silu_input(strip(s, CAST))
        if silu is None:
            continue
        g, nodes = silu
        casts = []
        n = s
        while is_op(n, CAST):
            casts.append(n)
            n = n.args[0]
        g_src = strip(g, CAST)
        out = [mul, *casts, *nodes, *([g] if g is not g_src else [])]
        out += _projection(g_src, out)
        out += _projection(u, out)
        _through_casts(mul, out)
        return out
    return None


# ---- attention ------------------------------------------------------------------------

_SCORE_OPS = ("aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.mul.Scalar",
              "aten.div.Tensor", "aten.div.Scalar", "aten.masked_fill.Scalar",
              "aten.masked_fill.Tensor", "aten.where.self", "aten.where.ScalarOther",
              "aten.where.ScalarSelf", CAST, *_VIEW_LIKE)


def _score_matmul(node, chain: list[fx.Node], depth: int = 0) -> fx.Node | None:
    """Walk up from the softmax input through scale / mask / cast / view ops to a matmul."""
    if depth > 16 or not isinstance(node, fx.Node):
        return None
    if is_op(node, *MATMULS):
        return node
    if not (is_op(node, *_SCORE_OPS) or category_of(node) == OpCategory.VIEW):
        return None
    for a in node.all_input_nodes:
        if is_tensor(a) and a.meta["val"].dim() >= 2:
            found = _score_matmul(a, chain, depth + 1)
            if found is not None:
                chain.append(node)
                return found
    return None


def match_attention(node: fx.Node) -> list[fx.Node] | None:
    if is_op(node, *SDPA_FORMS, "aten._scaled_dot_product_flash_attention_for_cpu.default"):
        return [node]
    if not is_op(node, "aten._softmax.default"):
        return None
    up: list[fx.Node] = []
    scores = _score_matmul(node.args[0], up)
    if scores is None:
        return None
    down = []
    n = node
    while True:
        u = only_user(n)
        if u is None:
            return None
        if is_op(u, *MATMULS) and u.args[0] is n:
            return [scores, *up, node, *down, u]
        if not (is_op(u, CAST, *_VIEW_LIKE) or category_of(u) == OpCategory.VIEW):
            return None
        down.append(u)
        n = u


MATCHERS = (("attention", match_attention), ("rmsnorm", match_rmsnorm),
            ("rope", match_rope), ("swiglu", match_swiglu))


def label_patterns(kg: KilnGraph) -> dict[str, int]:
    counts: dict[str, int] = {}
    for label, match in MATCHERS:
        for node in kg.graph.nodes:
            if node.op != "call_function" or KEY in node.meta:
                continue
            found = match(node)
            if not found:
                continue
            for n in found:
                n.meta.setdefault(KEY, label)
            counts[label] = counts.get(label, 0) + 1
    return counts


def clear_labels(kg: KilnGraph) -> None:
    for node in kg.graph.nodes:
        node.meta.pop(KEY, None)


@as_pass
def patterns(kg: KilnGraph, ctx) -> KilnGraph:
    clear_labels(kg)
    counts = label_patterns(kg)
    log.info("patterns: %s", counts or "none")
    return kg

