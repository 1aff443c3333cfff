"""as_strided that reads its input in order, every element once, becomes a view.

Decompositions leave such as_strided behind: AdaptiveAvgPool1d's strides its
[B, C, 1, 1] mean as itself (a Swin's pooled output). kiln has no kernel for
as_strided, so each fell back to PyTorch's op with a KilnWarning (and
`fallback="error"` refused the model). The rewrite runs before the supported-op check.
Any other as_strided (overlapping windows, an input that is not row-major, an offset
into its storage) is left to fall back.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from kiln.ir.symbolic import as_dim, same_dim

AS_STRIDED = torch.ops.aten.as_strided.default


def in_order_as_strided_as_views(gm: fx.GraphModule) -> None:
    """Each as_strided(x, size, stride[, offset]) that reads x in row-major order ->
    view(x, size)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is AS_STRIDED and _in_order(node):
            node.target, node.args, node.kwargs = torch.ops.aten.view.default, node.args[:2], {}
            changed = True
    if changed:
        gm.recompile()


def _in_order(node: fx.Node) -> bool:
    """x row-major (its eager strides, from export), the strides size's row-major ones
    from x's own first element, and as many elements as x: the two read x alike."""
    x, stride = node.args[0], node.args[2]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    val, out = x.meta["val"], node.meta["val"]
    if offset is not None and not same_dim(_dim(offset), as_dim(val.storage_offset())):
        return False
    return (_row_major(val.shape, val.stride()) and _row_major(out.shape, list(stride))
            and same_dim(_numel(val.shape), _numel(out.shape)))


def _dim(a):
    return as_dim(a.meta["val"] if isinstance(a, fx.Node) else a)


def _numel(shape):
    n = 1
    for d in shape:
        n = n * as_dim(d)
    return n


def _row_major(shape, strides) -> bool:
    """Are `strides` the row-major strides of `shape`? (A unit dim's stride is never used.)"""
    if len(shape) != len(strides):
        return False
    inner = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        d = as_dim(d)
        if not same_dim(d, 1) and not same_dim(_dim(s), inner):
            return False
        inner = inner * d
    return True
