"""Fold a per-channel scale and shift after a convolution into its weight and bias.

Eval-mode BatchNorm becomes `conv(x, W, b) * s + t` with s and t per output channel
(frontend/decompositions.py); that is `conv(x, W * s, b * s + t)`, one op instead of
three over the activation. The new weight and bias are computed from weights only, so
fold_constants (the next pass) makes them constants at compile time: the model runs
with BatchNorm gone, which eager PyTorch cannot do.

Only on the CPU target for now, where the convolution and every pointwise op are
separate ATen calls; the GPU targets keep the graph as it was. Folds a mul or add by a
constant (weights only) whose shape broadcasts along the channel dim alone, into a
non-transposed convolution whose only reader it is, in the same dtype. Repeats, so a
chain (mul, then add) folds whole.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.fold_constants import constant_nodes, constant_placeholders
from kiln.graph.rewrite import dtype, insert, is_op, replace, shape_of
from kiln.ir.graph import KilnGraph
from kiln.pipeline import as_pass

aten = torch.ops.aten


def _per_channel(node, conv: fx.Node, constants) -> bool:
    """`node` is a constant of conv's dtype whose shape, right-aligned against conv's,
    is C at the channel dim and 1 elsewhere."""
    if not isinstance(node, fx.Node) or node not in constants or dtype(node) != dtype(conv):
        return False
    out, shape = shape_of(conv), shape_of(node)
    if len(shape) > len(out) or len(out) < 2:
        return False
    padded = [1] * (len(out) - len(shape)) + list(shape)
    return padded[1] == out[1] and all(d == 1 for i, d in enumerate(padded) if i != 1)


def _foldable(conv: fx.Node, constants) -> tuple[fx.Node, str, fx.Node] | None:
    """(conv's reader, "mul" or "add", the per-channel constant) if it folds."""
    if not is_op(conv, "aten.convolution.default") or conv.args[6] or len(conv.users) != 1:
        return None
    if conv.args[1] not in constants or (conv.args[2] is not None
                                         and conv.args[2] not in constants):
        return None
    user = next(iter(conv.users))
    kind = "mul" if is_op(user, "aten.mul.Tensor") else \
        "add" if is_op(user, "aten.add.Tensor") and user.kwargs.get("alpha", 1) == 1 \
        and len(user.args) == 2 else None
    if kind is None or len(user.args) != 2 or dtype(user) != dtype(conv):
        return None
    other = user.args[1] if user.args[0] is conv else user.args[0]
    return (user, kind, other) if _per_channel(other, conv, constants) else None


def _fold(kg: KilnGraph, conv: fx.Node, user: fx.Node, kind: str, k: fx.Node) -> fx.Node:
    """The convolution with `user`'s constant folded in, placed at `user`."""
    x, w, b, *rest = conv.args
    channels = shape_of(conv)[1]
    flat = insert(kg, user, aten.view.default, (k, [channels]), like=user)
    if kind == "mul":
        lead = [channels] + [1] * (len(shape_of(w)) - 1)
        w = insert(kg, user, aten.mul.Tensor,
                   (w, insert(kg, user, aten.view.default, (k, lead), like=user)), like=conv)
        b = None if b is None else insert(kg, user, aten.mul.Tensor, (b, flat), like=conv)
    else:
        b = flat if b is None else insert(kg, user, aten.add.Tensor, (b, flat), like=conv)
    return insert(kg, user, aten.convolution.default, (x, w, b, *rest), like=conv)


def fold_conv_scales(kg: KilnGraph) -> int:
    folded = 0
    while any(is_op(n, "aten.convolution.default") for n in kg.graph.nodes):
        weights = constant_placeholders(kg)
        constants = set(weights) | set(constant_nodes(kg, weights))
        step = next(((n, *f) for n in kg.graph.nodes
                     if (f := _foldable(n, constants)) is not None), None)
        if step is None:
            return folded
        conv, user, kind, k = step
        new = _fold(kg, conv, user, kind, k)
        replace(user, new)
        kg.graph.erase_node(conv)
        eliminate_dead_code(kg)
        folded += 1
    return folded


@as_pass
def fold_conv_scale(kg: KilnGraph, ctx) -> KilnGraph:
    if getattr(ctx.target, "name", None) == "cpu" and fold_conv_scales(kg):
        kg.recompile()
    return kg
