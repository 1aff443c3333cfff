"""Selecting by a tensor's value (`self.table[x.argmax()]`) as an index op on the tensor.

Indexing with a 0-dim integer tensor is a select whose position is data. torch.export
captures it as `.item()` (an unbacked int, value unknown until run time) and a
`select` at that int; kiln plans at compile time, so the int was a dead end (a raw
AttributeError from its -inf lower bound, fuzzer issue 11 item 9). The same select
is `aten.index` with the tensor itself as the index, which needs no value at compile
time: eager's `table[t]` is exactly that, negative positions included.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


def select_by_tensor_as_index(gm: fx.GraphModule) -> None:
    """Rewrite select(x, dim, item(t)) to index(x, [None] * dim + [t]) where every use
    of the item is such a select; other uses of .item() stay (and are refused)."""
    for item in list(gm.graph.nodes):
        if item.op != "call_function" or item.target is not aten._local_scalar_dense.default:
            continue
        src = item.args[0]
        val = src.meta.get("val") if isinstance(src, fx.Node) else None
        if not _is_index(val) or not item.users or not all(_selects_by(u, item)
                                                           for u in item.users):
            continue
        for sel in list(item.users):
            _rewrite(gm, sel, src, val)
        gm.graph.erase_node(item)
    gm.recompile()


def _is_index(val) -> bool:
    return isinstance(val, torch.Tensor) and val.numel() == 1 and \
        val.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _selects_by(node: fx.Node, item: fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten.select.int and \
        len(node.args) == 3 and node.args[2] is item and node.args[0] is not item


def _rewrite(gm: fx.GraphModule, sel: fx.Node, src: fx.Node, val: torch.Tensor) -> None:
    x, dim = sel.args[0], sel.args[1]
    rank = x.meta["val"].dim()
    dim = dim % rank if rank else 0
    with gm.graph.inserting_before(sel):
        index = src
        if val.dim() != 0:  # t.item() of a one-element tensor of any shape
            index = gm.graph.call_function(aten.view.default, (src, []))
            index.meta.update(src.meta)
            index.meta["val"] = val.reshape([])
        new = gm.graph.call_function(aten.index.Tensor, (x, [None] * dim + [index]))
        new.meta.update(sel.meta)
    sel.replace_all_uses_with(new)
    gm.graph.erase_node(sel)
