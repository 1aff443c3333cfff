"""Canonicalize: one spelling per meaning, and no ops that compute nothing.

Rewrites, in one forward sweep (inputs are rewritten before their users):
- split_with_sizes / split / unbind read through getitem -> slice / select of the
  source. Codegen indexes through views, not through tuples (the chunk in HF and
  gpt-fast RoPE produces split_with_sizes + getitem).
- transpose.int and t -> permute, with non-negative dims; a permute that moves only
  unit dims -> view (row-major order is unchanged); _unsafe_view and reshape
  -> view (in kiln's value semantics all three are a logical reshape), with every
  size spelled out (no -1), so equal views look equal to CSE and to matchers.
- identity ops -> their input: clone, alias, detach, lift_fresh_copy, a _to_copy to
  the same dtype and device, view / reshape / expand to the same shape, squeeze of no
  unit dim, identity permute, cat of one tensor, and a slice that keeps every element
  (start 0, step 1, an end that provably reaches the size: a bounds question, and an
  unbounded size just keeps the slice), and a functional copy(x, src) of one element
  whose src has x's shape, dtype and device (the value is src's: transformers'
  StaticCache sets each layer's `cumulative_length` so; x's old value, then read by
  nothing, may be written in place, dispatch/reinplace.py; larger states keep their
  copy, which reinplace writes in place as a copy_).
- algebraic identities where the result's dtype and shape provably equal the
  operand's: x*1, 1*x, x/1, x+0, 0+x, x-0, x**1, -(-x).

Establishes `no-identity-views`. Assumes a functional core-ATen graph (after import).
"""

from __future__ import annotations

import torch.fx as fx

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.rewrite import (
    aten,
    dim_arg,
    dtype,
    insert,
    is_op,
    is_tensor,
    is_unit,
    name_of,
    provably_le,
    rank,
    replace,
    same_shape,
    scalar_arg,
    shape_args,
)
from kiln.ir.graph import KilnGraph, shape_of
from kiln.ir.ops import IDENTITY_OPS, RESHAPES, SPLITS, SQUEEZES, bind_args, norm_axis
from kiln.ir.symbolic import as_dim
from kiln.pipeline import as_pass

# Ops that are an identity when their result has their input's shape (unsqueeze never).
SAME_SHAPE_IDENTITY = RESHAPES | SQUEEZES | {"aten.expand.default"}


def split_to_slices(kg: KilnGraph, node: fx.Node) -> bool:
    """getitem(split(x), i) -> slice(x, dim, start, end); getitem(unbind(x), i) -> select."""
    users = list(node.users)
    if not users or not all(name_of(u) == "getitem" for u in users):
        return False
    x = node.args[0]
    name = name_of(node)
    dim = norm_axis(bind_args(node)["dim"], rank(x))
    parts = node.meta["val"]
    starts, offset = [], 0
    for p in parts:
        starts.append(offset)
        if name != "aten.unbind.int":
            offset = offset + p.shape[dim]
    for u in users:
        i = u.args[1]
        if name == "aten.unbind.int":
            new = insert(kg, u, aten.select.int, (x, dim, i), like=u)
        else:
            start = dim_arg(kg, starts[i], u)
            end = dim_arg(kg, starts[i] + parts[i].shape[dim], u)
            if start is None or end is None:
                continue  # a symbolic offset with no size to read it from: keep the tuple
            new = insert(kg, u, aten.slice.Tensor, (x, dim, start, end), like=u)
        replace(u, new)
    return True


def to_permute(kg: KilnGraph, node: fx.Node) -> fx.Node | None:
    """transpose.int / t as the equivalent permute (None when it is an identity)."""
    x = node.args[0]
    r = rank(x)
    perm = list(range(r))
    if name_of(node) == "aten.t.default":
        if r < 2:
            return None
        perm = [1, 0]
    else:
        a, b = norm_axis(node.args[1], r), norm_axis(node.args[2], r)
        perm[a], perm[b] = perm[b], perm[a]
    if perm == list(range(r)):
        return None
    return insert(kg, node, aten.permute.default, (x, perm), like=node)


def canonical_view(kg: KilnGraph, node: fx.Node) -> fx.Node | None:
    """_unsafe_view / reshape / a view with -1 -> view with every size spelled out."""
    sizes = list(node.args[1])
    if name_of(node) == "aten.view.default" and -1 not in sizes:
        return None
    explicit = [dim_arg(kg, d, node) if s == -1 else s for s, d in zip(sizes, shape_of(node))]
    if any(a is None for a in explicit):
        if name_of(node) == "aten.view.default":
            return None  # a size with no node to read it from: keep the -1
        explicit = sizes
    return insert(kg, node, aten.view.default, (node.args[0], explicit), like=node)


def unit_permute_as_view(kg: KilnGraph, node: fx.Node) -> fx.Node | None:
    """A permute that moves only unit dims keeps row-major order: it is a reshape.

    ([1, T, 4, 8] -> [T, 4, 8, 1], or decode's [B, 1, H, D] -> [B, H, 1, D].) A dim is
    unit when its bounds are [1, 1]; any other symbolic dim is assumed not to be.
    """
    x = node.args[0]
    shape = shape_of(x)
    perm = [norm_axis(d, rank(x)) for d in node.args[1]]
    moved = [d for d in perm if not is_unit(shape[d], kg.symbols)]
    if moved != sorted(moved) or perm == list(range(len(perm))):
        return None
    sizes = shape_args(kg, shape_of(node), node)
    if sizes is None:
        return None
    return insert(kg, node, aten.view.default, (x, sizes), like=node)


def identity_source(kg: KilnGraph, node: fx.Node) -> fx.Node | None:
    """The value `node` equals without computing anything, if it is an identity."""
    name = name_of(node)
    args = node.args
    x = args[0] if args else None
    if not is_tensor(x) or not is_tensor(node):
        return None
    if name in IDENTITY_OPS:
        return x
    if name in SAME_SHAPE_IDENTITY:
        return x if same_shape(x, node) else None
    if name == "aten.permute.default":
        perm = [norm_axis(d, rank(x)) for d in args[1]]
        return x if perm == list(range(rank(x))) else None
    if name == "aten._to_copy.default":
        same = dtype(x) == dtype(node) and x.meta["val"].device == node.meta["val"].device
        return x if same else None
    if name == "aten.slice.Tensor":
        return x if _full_slice(kg, node) else None
    if name == "aten.copy.default":  # x's one element replaced: the value is src's
        src = args[1]
        same = (is_tensor(src) and dtype(src) == dtype(node) and same_shape(src, node)
                and src.meta["val"].device == node.meta["val"].device
                and node.meta["val"].numel() == 1)
        return src if same else None
    return _algebraic_identity(node)


def _full_slice(kg: KilnGraph, node: fx.Node) -> bool:
    a = bind_args(node)
    x, start, end, step = a["self"], a["start"], a["end"], a["step"]
    dim = norm_axis(a["dim"], rank(x))
    if start not in (None, 0) or step != 1:
        return False
    if same_shape(x, node) or end is None:
        return True
    if isinstance(end, fx.Node):
        end = end.meta["val"]
    return provably_le(shape_of(x)[dim], as_dim(end), kg.symbols)


_NEUTRAL = {  # op -> (neutral scalar, may the scalar come first?)
    "aten.mul.Tensor": (1, True), "aten.mul.Scalar": (1, False),
    "aten.div.Tensor": (1, False), "aten.div.Scalar": (1, False),
    "aten.add.Tensor": (0, True), "aten.add.Scalar": (0, False),
    "aten.sub.Tensor": (0, False), "aten.sub.Scalar": (0, False),
    "aten.pow.Tensor_Scalar": (1, False),
}


def _algebraic_identity(node: fx.Node) -> fx.Node | None:
    name = name_of(node)
    if name == "aten.neg.default":
        inner = node.args[0]
        return inner.args[0] if is_op(inner, "aten.neg.default") else None
    if name not in _NEUTRAL or len(node.args) < 2:
        return None
    neutral, commutes = _NEUTRAL[name]
    candidates = [(node.args[0], scalar_arg(node, 1))]
    if commutes:
        candidates.append((node.args[1], scalar_arg(node, 0)))
    for x, scalar in candidates:
        if (scalar is not None and scalar == neutral and is_tensor(x)
                and dtype(x) == dtype(node) and same_shape(x, node)):
            return x
    return None


def canonicalize_graph(kg: KilnGraph) -> int:
    changed = 0
    for node in list(kg.graph.nodes):
        if node.op != "call_function" or node._erased:
            continue
        name = name_of(node)
        if name in SPLITS:
            changed += split_to_slices(kg, node)
            continue
        if name in ("aten.transpose.int", "aten.t.default"):
            new = to_permute(kg, node) or node.args[0]
            replace(node, new)
            node = new
            changed += 1
        if not isinstance(node, fx.Node) or node.op != "call_function":
            continue
        if name == "aten.permute.default" and (view := unit_permute_as_view(kg, node)):
            replace(node, view)
            node = view
            changed += 1
        if name in RESHAPES and (view := canonical_view(kg, node)) is not None:
            replace(node, view)
            node = view
            changed += 1
        src = identity_source(kg, node)
        if src is not None:
            replace(node, src)
            changed += 1
    return changed


@as_pass(establishes=("no-identity-views",))
def canonicalize(kg: KilnGraph, ctx) -> KilnGraph:
    if canonicalize_graph(kg):
        eliminate_dead_code(kg)
        kg.recompile()
    return kg
