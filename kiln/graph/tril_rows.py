"""Rows gathered from a constant causal buffer become the comparison they hold.

gpt-fast (and kiln bench's model) slice the mask from a [M, M] tril of ones by the input
positions, `causal[None, None, input_pos]`: row p passes keys 0..p. Read as data, the
mask is a gather of M bytes a query row (4.7 MB a prefill of 2048 over a 2304-slot
cache), its envelope a reduction over them, and the attention kernel keeps the loops
that read it tile by tile. Written as `arange(M) <= input_pos[i]` it is computed where
it is used, and its form passes each row a prefix of the keys (dispatch/prefix_mask.py),
so the kernel has no mask loops. torch reads a negative row from the end (row -1 is
the last): a negative position is read as position + M, as exact as the gather for
every index it accepts. Cheap ops only (a compare, an add, a select), so a decode step
recomputes the mask where each kernel reads it (dispatch/recompute_cheap.py). Only a
buffer whose values are known and are a tril of ones (index_forms.py's check) is
rewritten; an index of anything else is left alone.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from kiln.graph.fold_constants import constant_placeholders, note_values_read
from kiln.graph.index_forms import IndexForms, X
from kiln.graph.rewrite import insert, name_of, replace, reshape_to
from kiln.ir.graph import KilnGraph, shape_of
from kiln.ir.symbolic import same_dim
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.graph")
aten = torch.ops.aten


def _row_index(node: fx.Node):
    """The index tensor of `x[None, ..., rows]` reading whole rows of x's last two dims
    (every dim before them unit and unindexed); None for any other index."""
    src, indices = node.args[0], node.args[1]
    r = len(shape_of(src))
    if r < 2 or len(indices) != r - 1 or any(i is not None for i in indices[:-1]):
        return None
    rows = indices[-1]
    if not isinstance(rows, fx.Node) or rows.meta["val"].dtype not in (torch.int64,
                                                                      torch.int32):
        return None
    return rows


def rewrite_tril_rows(kg: KilnGraph) -> int:
    forms = IndexForms(constant_placeholders(kg))
    done = 0
    for node in list(kg.graph.nodes):
        if name_of(node) != "aten.index.Tensor" or node.meta["val"].dtype != torch.bool:
            continue
        rows = _row_index(node)
        src = node.args[0]
        if rows is None or forms.of(src) != (X[0] <= X[1]):
            continue
        m = shape_of(src)[-1]
        if not isinstance(m, int) or shape_of(src)[-2] != m:
            continue
        j = insert(kg, node, aten.arange.start_step, (0, m),
                   {"dtype": rows.meta["val"].dtype, "device": rows.meta["val"].device},
                   like=node)
        p = insert(kg, node, aten.unsqueeze.default, (rows, -1), like=node)
        below = insert(kg, node, aten.lt.Scalar, (p, 0), like=node)
        wrapped = insert(kg, node, aten.add.Tensor, (p, m), like=node)
        p = insert(kg, node, aten.where.self, (below, wrapped, p), like=node)
        keep = insert(kg, node, aten.le.Tensor, (j, p), like=node)
        same = len(shape_of(keep)) == len(shape_of(node)) and all(
            same_dim(a, b) for a, b in zip(shape_of(keep), shape_of(node)))
        out = keep if same else reshape_to(kg, keep, node)
        if out is None:
            continue
        replace(node, out)
        done += 1
    note_values_read(kg, forms.read)
    return done


@as_pass
def tril_rows(kg: KilnGraph, ctx) -> KilnGraph:
    done = rewrite_tril_rows(kg)
    if done:
        log.info("tril_rows: %d masks gathered from a causal buffer written as comparisons",
                 done)
        kg.recompile()
    return kg
