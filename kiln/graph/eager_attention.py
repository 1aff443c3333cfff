"""Attention written out (q @ k^T, scaled, masked, softmax, @ v) becomes one
scaled_dot_product_attention op: kiln's attention kernel instead of three.

nanoGPT's and minGPT's CausalSelfAttention, transformers' `eager` attention and much
research code compute attention by hand. kiln ran it as written: a batched product, a
softmax reduction, a second product, the [.., T, S] scores stored and read back (a
2048-token prompt's, 2048 x 2048 x 4 bytes a head a layer), and at decode three
dependent kernels where the attention kernel is one (split over the keys). The chain is
SDPA's definition, softmax(q @ k^T * scale + mask) @ v, so it is rewritten to the op,
which graph/patterns.py labels "attention" either way. Scores soft-capped before the
mask, cap * tanh(s * f / cap) (Gemma 2), become kiln.ops.softcap_attention: SDPA's
arguments and the cap.

Matched from a softmax over the last dim, every value between it and the products read
by the chain alone (scores returned or reused stay as written):
- above it: casts; at most one mask, nearest the softmax (where / masked_fill of -inf:
  a boolean mask; of a finite fill of at least 1e30 in size, transformers' finfo.min: an
  additive mask of it, which sends the masked scores to the same value; `+ m` of a
  tensor: additive); scalings by Python numbers (mul, div), their product the scale;
  a view of a 3-d bmm to [B, H, T, S]; the bmm of views of q [B, H, T, D] and of k^T;
- below it: casts and a view to bmm(p, view of v [B, H, S, Dv]), viewed back to 4-d;
- without the 4-d views: the 3-d bmm operands themselves, one head of [N, T, D].
- a softcap: mul(tanh(x), c), scalings below the tanh (scale * c = their product times
  c, the cap c), none of the mask under it.
A mask applied before a scaling is not SDPA's order and stays as written, unless it
fills -inf. q, k, v and the output share one dtype. Eager rounds the scores to that
dtype before an fp32 softmax; the kernel keeps them in fp32 (within fp16 tolerance).
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.rewrite import aten, insert, is_op, name_of, rank, shape_args
from kiln.ir.graph import KilnGraph
from kiln.ir.ops import norm_axis
from kiln.ir.symbolic import same_dim
from kiln.ops.softcap_attention import softcap_attention
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.graph")

SOFTMAX = "aten._softmax.default"
BMM = "aten.bmm.default"
VIEW = "aten.view.default"
CAST = "aten._to_copy.default"
_SCALES = {"aten.mul.Tensor": False, "aten.mul.Scalar": False,
           "aten.div.Tensor": True, "aten.div.Scalar": True}
_FILLS = ("aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf",
          "aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
HUGE_FILL = 1e30  # a finite fill this large drowns any score it is added to


def _cast(node) -> bool:
    """A dtype change and nothing else (`.float()`, `.to(q.dtype)`, which records the
    layout and device beside: a region's device is the tensor's own)."""
    kw = node.kwargs if is_op(node, CAST) else None
    return (kw is not None and set(kw) <= {"dtype", "layout", "device", "memory_format"}
            and kw.get("layout", torch.strided) == torch.strided)


def _number(x) -> float | None:
    """A Python number, or a 0-d scalar_tensor / full([]) node's value."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return float(x)
    if is_op(x, "aten.scalar_tensor.default") and isinstance(x.args[0], (int, float)):
        return float(x.args[0])
    if is_op(x, "aten.full.default") and list(x.args[0]) == [] and \
            isinstance(x.args[1], (int, float)):
        return float(x.args[1])
    return None


def _fill(node, chain) -> tuple[fx.Node, bool, float] | None:
    """(condition, whether it marks the lanes filled, the fill) of a masked fill of the
    chain's value `chain`, else None."""
    name = name_of(node)
    if name.startswith("aten.masked_fill"):
        x, cond, value = node.args[:3]
        return (cond, True, _number(value)) if x is chain else None
    cond, a, b = node.args[:3]
    if b is chain and a is not chain:
        return cond, True, _number(a)
    if a is chain and b is not chain:
        return cond, False, _number(b)
    return None


def _leads_to_scores(x, depth: int = 0) -> bool:
    """Does `x` come from a bmm through the ops a score chain holds (a mask does not)?"""
    if not isinstance(x, fx.Node) or depth > 12:
        return False
    if is_op(x, BMM):
        return True
    name = name_of(x)
    if not (_cast(x) or name in _SCALES or name in _FILLS or name == VIEW
            or name in ("aten.add.Tensor", "aten.tanh.default")):
        return False
    return any(_leads_to_scores(a, depth + 1) for a in x.args if isinstance(a, fx.Node))


class _Match:
    """The chain around one softmax, found by `match`."""

    def __init__(self):
        self.scale, self.scaled = 1.0, False
        self.cap: float | None = None  # the softcap: the scalings above its tanh
        # ("bool", cond, marks_filled) | ("add", tensor) | ("fill", cond, value, marks_filled)
        self.mask: tuple | None = None
        self.scores4 = None  # the [B, H, T, S] view of the scores bmm, if taken
        self.scores = self.out = None

    def up(self, node) -> bool:
        """From the softmax's input to the scores bmm."""
        while True:
            if not isinstance(node, fx.Node) or len(node.users) != 1:
                return False
            name = name_of(node)
            if name == BMM:
                self.scores = node
                return True
            if _cast(node):
                node = node.args[0]
            elif name == VIEW:
                if self.scores4 is not None or rank(node) != 4 or \
                        not is_op(node.args[0], BMM):
                    return False
                self.scores4, node = node, node.args[0]
            elif name in _SCALES:
                node = self._scale(node, _SCALES[name])
            elif name in _FILLS or name == "aten.add.Tensor":
                node = self._mask(node)
            elif name == "aten.tanh.default":
                node = self._softcap(node)
            else:
                return False
            if node is None:
                return False

    def _scale(self, node, divide: bool):
        a, b = node.args[:2]
        if divide:
            x, f = a, _number(b)
        else:
            x, f = (a, _number(b)) if _number(b) is not None else (b, _number(a))
        if f is None or f <= 0 or not isinstance(x, fx.Node) or _number(x) is not None:
            return None
        self.scale *= 1.0 / f if divide else f
        self.scaled = True
        return x

    def _softcap(self, node):
        """cap * tanh(x): the scalings seen so far (above the tanh) are the cap; those
        below it, times the cap, SDPA's scale."""
        if self.cap is not None:
            return None
        self.cap, self.scale, self.scaled = self.scale, 1.0, False
        return node.args[0]

    def _mask(self, node):
        if self.mask is not None or self.cap is not None:
            return None  # a second mask, or one under the cap (tanh(-inf) is not -inf)
        if name_of(node) == "aten.add.Tensor":
            a, b = node.args[:2]
            if node.kwargs.get("alpha", 1) != 1 or not all(isinstance(x, fx.Node) for x in (a, b)):
                return None
            if _leads_to_scores(a) == _leads_to_scores(b):
                return None
            chain, m = (a, b) if _leads_to_scores(a) else (b, a)
            if self.scaled or m.meta["val"].dtype != node.meta["val"].dtype:
                return None  # added before a scaling: not SDPA's order
            self.mask = ("add", m)
            return chain
        for chain in node.args[:3]:
            if not isinstance(chain, fx.Node):
                continue
            found = _fill(node, chain)
            if found is None or found[2] is None:
                continue
            cond, marks, value = found
            if cond.meta["val"].dtype != torch.bool:
                return None
            if value == -math.inf:
                self.mask = ("bool", cond, marks)
            elif value <= -HUGE_FILL and not self.scaled:
                self.mask = ("fill", cond, value, marks)
            else:
                return None
            return chain
        return None

    def down(self, softmax) -> bool:
        """From the softmax to the output bmm (and its 4-d view)."""
        node = softmax
        while True:
            if len(node.users) != 1:
                return False
            (user,) = node.users
            if is_op(user, BMM) and user.args[0] is node:
                self.out = user
                break
            if not (_cast(user) or is_op(user, VIEW)):
                return False
            node = user
        return True


def match(softmax: fx.Node) -> _Match | None:
    if not is_op(softmax, SOFTMAX) or softmax.args[2]:
        return None
    if norm_axis(softmax.args[1], rank(softmax)) != rank(softmax) - 1:
        return None
    m = _Match()
    return m if m.up(softmax.args[0]) and m.down(softmax) else None


def _operands(kg: KilnGraph, m: _Match):
    """(q, k^T, v) as SDPA reads them: the 4-d values the bmm operands view (a 4-d view
    of their source made where the view composed more: repeat_kv's expand), or the 3-d
    operands themselves; None when they are not that."""
    q, kt = m.scores.args[:2]
    v = m.out.args[1]
    if m.scores4 is None:
        return (q, kt, v) if rank(q) == 3 else None
    b, h, t, s = m.scores4.meta["val"].shape
    n3, t3, s3 = m.scores.meta["val"].shape
    if not (same_dim(n3, b * h) and same_dim(t3, t) and same_dim(s3, s)):
        return None  # the 4-d view must split the batch of heads, nothing else
    found = []
    for x in (q, kt, v):
        if not is_op(x, VIEW) or not same_dim(x.meta["val"].shape[0], b * h):
            return None
        src = x.args[0]
        want = (b, h, *x.meta["val"].shape[1:])
        have = src.meta["val"].shape
        if not (len(have) == 4 and all(same_dim(p, w) for p, w in zip(have, want))):
            sizes = shape_args(kg, want, m.out)
            if sizes is None:
                return None
            src = insert(kg, m.out, aten.view.default, (src, sizes), like=x)
        found.append(src)
    qs, ks, vs = (x.meta["val"].shape for x in found)
    if not (same_dim(qs[2], t) and same_dim(ks[3], s) and same_dim(vs[2], s)
            and same_dim(qs[3], ks[2])):
        return None
    return tuple(found)


def _key(kg: KilnGraph, kt: fx.Node, at: fx.Node) -> fx.Node:
    """k from k^T: a permute of k^T's source when k^T is a permute, else of k^T."""
    r = rank(kt)
    if is_op(kt, "aten.permute.default"):
        perm = [norm_axis(d, r) for d in kt.args[1]]
        perm[-2], perm[-1] = perm[-1], perm[-2]
        if perm == list(range(r)):
            return kt.args[0]
        return insert(kg, at, aten.permute.default, (kt.args[0], perm), like=kt)
    return insert(kg, at, aten.permute.default, (kt, [*range(r - 2), r - 1, r - 2]), like=kt)


def _attn_mask(kg: KilnGraph, m: _Match, at: fx.Node, dtype: torch.dtype):
    if m.mask is None:
        return None
    kind = m.mask[0]
    if kind == "add":
        return m.mask[1]
    if kind == "bool":
        _, cond, marks = m.mask
        if not marks:
            return cond
        if is_op(cond, "aten.logical_not.default", "aten.bitwise_not.default"):
            return cond.args[0]  # masked_fill(~keep, -inf): keep itself
        return insert(kg, at, aten.logical_not.default, (cond,), like=at)
    _, cond, value, marks = m.mask  # a finite fill as an additive mask of it
    pair = (value, 0.0) if marks else (0.0, value)
    fill = insert(kg, at, aten.where.Scalar, (cond, *pair), like=at)
    return insert(kg, at, aten._to_copy.default, (fill,), {"dtype": dtype}, like=at)


def _replace_output(kg: KilnGraph, m: _Match, sdpa: fx.Node) -> None:
    """SDPA's output for the output bmm's: as it is in the 3-d form; in the 4-d form
    each view of the bmm's output a view of SDPA's (composed, not chained), any other
    reader a 3-d view of it."""
    if m.scores4 is None:
        m.out.replace_all_uses_with(sdpa)
        return
    for user in list(m.out.users):
        if is_op(user, VIEW):
            user.replace_all_uses_with(sdpa if _same_shape(user, sdpa) else insert(
                kg, user, aten.view.default, (sdpa, user.args[1]), like=user))
    if m.out.users:
        sizes = shape_args(kg, m.out.meta["val"].shape, m.out)
        m.out.replace_all_uses_with(insert(kg, m.out, aten.view.default, (sdpa, sizes),
                                           like=m.out))


def _same_shape(a: fx.Node, b: fx.Node) -> bool:
    """Do two values have the same shape (an identity view between them)?"""
    x, y = a.meta["val"].shape, b.meta["val"].shape
    return len(x) == len(y) and all(same_dim(p, q) for p, q in zip(x, y))


def rewrite_eager_attention(kg: KilnGraph) -> int:
    """Rewrite every matched chain to SDPA; returns how many."""
    done = tried = 0
    for node in list(kg.graph.nodes):
        m = match(node) if not getattr(node, "_erased", False) else None
        if m is None:
            continue
        tried += 1  # _operands may add views a later check leaves unread
        ops = _operands(kg, m)
        if ops is None:
            continue
        q, kt, v = ops
        dtypes = {x.meta["val"].dtype for x in (q, kt, v, m.out)}
        if len(dtypes) != 1 or not dtypes <= {torch.float16, torch.bfloat16, torch.float32}:
            continue
        if m.mask is not None and m.mask[0] == "add" and m.mask[1].meta["val"].dtype not in dtypes:
            continue
        at = m.out
        k = _key(kg, kt, at)
        mask = _attn_mask(kg, m, at, q.meta["val"].dtype)
        if m.cap is None:
            op, kw = aten.scaled_dot_product_attention.default, {"scale": m.scale}
        else:
            op, kw = softcap_attention._opoverload, {"scale": m.scale * m.cap,
                                                      "softcap": m.cap}
        sdpa = insert(kg, at, op, (q, k, v, mask), kw, like=node, val=_sdpa_value(kg, q, v))
        _replace_output(kg, m, sdpa)
        done += 1
    if tried:
        eliminate_dead_code(kg)
    if done:
        log.info("eager attention: %d chains as scaled_dot_product_attention", done)
    return done


def _sdpa_value(kg: KilnGraph, q: fx.Node, v: fx.Node):
    """The attention's fake output, q's rows by v's width: not from running SDPA on fake
    CUDA inputs, whose flash path pads the head dim and fails on a symbolic size."""
    qv, vv = q.meta["val"], v.meta["val"]
    with kg.fake_mode():
        return qv.new_empty((*qv.shape[:-1], vv.shape[-1]))


@as_pass
def eager_attention(kg: KilnGraph, ctx) -> KilnGraph:
    rewrite_eager_attention(kg)
    return kg
