"""Which FX nodes fuse into which region: the grouping rules of dispatch formation.

Nodes are visited consumers-first. A producer joins its consumer's group when every
one of its consumers is in that group (so a group has one value leaving it: its
root) and the group's kind accepts it:

- pointwise, gather, concat ops fuse into anything but extern; into a matmul only
  after the product (epilogue: bias, activation, residual, cast), except a cast that
  widens an operand the product alone reads (`F.linear(x.float(), w.float())`, a
  router's: the kernel loads the narrow values and widens them in registers, where
  apart a kernel wrote the wide copy, a weight's every step, and the product read it
  back); into attention and
  copy (scatter) regions only before (prologue: RoPE, masks, values written), into a
  topk only before and only when kiln generates that topk (a router's sigmoid and
  bias: the kernel computes its row from them, as it computes reductions over the
  rows it picks from, a router's softmax; a topk that runs as torch's op would
  run its prologue as torch ops too, so that one keeps its producers apart); into a
  reduction as its prologue unless that would recompute costly math many times over
  a broadcast (dispatch/recompute.py: then it stays apart, usually as the row
  epilogue of the reduction that computes its input);
- a reduction joins a group whose iteration domain is its input shape (RMSNorm's
  final multiply, softmax's divide), or a group already reducing the same axes of
  the same shape (softmax's max and sum; a MoE's gathered gate and up products of
  one x), or, as its row epilogue, a pointwise group over its own output shape that
  reads it directly (silu(g) * u after the gate and up sums: stored once), when its
  rows are innermost and short enough to be held whole (ROW_EPILOGUE_MAX), where the
  reduction kernel computes per-row values anyway;
- a matmul joins a group that so far holds only its pointwise epilogue;
- attention, scatter, topk and extern ops start groups of their own, except that a
  block-scaled fp8 linear (kiln::fp8_linear) joins a group of residual adds (and
  casts) over its own output that read it directly: its kernel adds them before its
  store, as a matmul's epilogue does.

View ops never join a group: each consumer folds them into its index maps. CREATE
ops (arange, full) are recomputed inside every region that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.dispatch.recompute import costly_broadcast
from kiln.ir.graph import shape_of
from kiln.ir.ops import (
    OpCategory,
    category,
    op_name,
    reduction_dims,
    topk_args,
    topk_problem,
)
from kiln.ir.plan import RegionKind
from kiln.ir.symbolic import Bounds, same_dim

POINTWISE_LIKE = {OpCategory.POINTWISE, OpCategory.GATHER, OpCategory.CONCAT}
ANCHORS = {OpCategory.MATMUL, OpCategory.ATTENTION, OpCategory.REDUCTION,
           OpCategory.SCATTER, OpCategory.TOPK, OpCategory.EXTERN}
# The longest static row a reduction takes a row epilogue for, innermost or strided:
# the reduction template holds such rows whole (codegen/templates/reduction/forms.py,
# PERSISTENT_MAX, PERSISTENT_MAX_STRIDED); longer rows of few outputs may take its split
# form, which stores only the sums.
ROW_EPILOGUE_MAX, ROW_EPILOGUE_MAX_STRIDED = 16384, 64
FP8_LINEAR = "kiln.fp8_linear.default"
CAST = "aten._to_copy.default"
_RESIDUAL_OPS = {"aten.add.Tensor", CAST}


def cat_of(node: fx.Node) -> OpCategory | None:
    if node.op != "call_function":
        return None
    c = category(op_name(node.target))
    if c == OpCategory.TUPLE:  # getitem: a view of a view-tuple, else part of its producer
        src = node.args[0]
        return OpCategory.VIEW if cat_of(src) == OpCategory.VIEW else OpCategory.TUPLE
    return c


def is_compute(node: fx.Node) -> bool:
    c = cat_of(node)
    return c is not None and c not in (OpCategory.VIEW, OpCategory.CREATE, OpCategory.TUPLE) \
        and not isinstance(node.meta.get("val"), torch.SymInt)


@dataclass
class Group:
    root: fx.Node
    members: list[fx.Node] = field(default_factory=list)
    anchor: fx.Node | None = None  # the matmul / attention / reduction / scatter / extern op
    prologue: set[fx.Node] = field(default_factory=set)  # members feeding the anchor

    @property
    def kind(self) -> RegionKind:
        if self.anchor is not None:
            return {
                OpCategory.MATMUL: RegionKind.MATMUL,
                OpCategory.ATTENTION: RegionKind.ATTENTION,
                OpCategory.REDUCTION: RegionKind.REDUCTION,
                OpCategory.SCATTER: RegionKind.COPY,
                OpCategory.TOPK: RegionKind.TOPK,
                OpCategory.EXTERN: RegionKind.EXTERN,
            }[cat_of(self.anchor)]
        if any(cat_of(m) == OpCategory.POINTWISE for m in self.members):
            return RegionKind.POINTWISE
        return RegionKind.COPY

    def add(self, node: fx.Node, feeds_anchor: bool) -> None:
        self.members.append(node)
        if cat_of(node) in ANCHORS and self.anchor is None:
            self.anchor = node
            self.prologue.add(node)
        elif feeds_anchor:
            self.prologue.add(node)


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes
            if isinstance(a.meta.get("val"), (torch.Tensor, tuple, list))]


def compute_consumers(node: fx.Node) -> tuple[set[fx.Node], bool]:
    """Compute nodes that read `node` (seeing through views and getitems); and whether
    the value (or a view of it) is returned from the graph."""
    found: set[fx.Node] = set()
    returned = False
    stack = list(node.users)
    seen = set()
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if u.op == "output":
            returned = True
        elif cat_of(u) in (OpCategory.VIEW, OpCategory.TUPLE):
            stack.extend(u.users)
        else:
            found.add(u)
    return found, returned


def _reduction_key(node: fx.Node):
    src = node.args[0]
    shape = shape_of(src)
    dims = reduction_dims(op_name(node.target), node.args, node.kwargs, len(shape))
    return shape, dims


def can_join(p: fx.Node, g: Group, consumers: set[fx.Node],
             symbols: dict[str, Bounds] | None = None) -> bool:
    """May producer `p`, all of whose consumers are in `g`, fuse into `g`?"""
    c = cat_of(p)
    feeds_anchor = any(u in g.prologue for u in consumers)
    anchor = cat_of(g.anchor) if g.anchor is not None else None
    if c in POINTWISE_LIKE:
        if anchor == OpCategory.EXTERN:
            return False
        if anchor == OpCategory.MATMUL:
            return not feeds_anchor or _widened_operand(p, g, consumers)
        if anchor in (OpCategory.ATTENTION, OpCategory.SCATTER):
            return feeds_anchor
        if anchor == OpCategory.TOPK:
            return feeds_anchor and generated_topk(g.anchor)
        if anchor == OpCategory.REDUCTION and feeds_anchor:
            return not costly_broadcast(p, g.anchor, symbols or {})
        return True
    if c == OpCategory.REDUCTION:
        if _is_tuple(p):
            return False
        if anchor is None:
            return shape_of(p.args[0]) == shape_of(g.root) or _row_epilogue(p, g)
        if anchor == OpCategory.REDUCTION:
            return _reduction_key(p) == _reduction_key(g.anchor)
        if anchor == OpCategory.TOPK:
            return feeds_anchor and generated_topk(g.anchor) and _over_topk_rows(p, g.anchor)
        return False
    if c == OpCategory.MATMUL:
        return anchor is None and all(cat_of(m) in POINTWISE_LIKE for m in g.members)
    if c == OpCategory.EXTERN:
        return anchor is None and _fp8_residual_epilogue(p, g)
    return False


def _widened_operand(p: fx.Node, g: Group, consumers: set[fx.Node]) -> bool:
    """Is `p` a cast that widens a floating operand of matmul group `g`'s product, read
    by the product alone? A narrowing cast stays apart: its producer would store the
    wide value (an RMSNorm ending in `.to(bf16)` keeps it, and folds into decode GEMVs)."""
    if op_name(p.target) != CAST or consumers != {g.anchor} or len(p.args) != 1:
        return False
    if set(p.kwargs) - {"dtype", "layout", "device"}:
        return False
    src, out = p.args[0].meta.get("val"), p.meta.get("val")
    if not (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)):
        return False
    # fp8 sources stay apart: not every GPU converts them in registers
    return (src.dtype.is_floating_point and out.dtype.is_floating_point
            and src.device == out.device and 2 <= src.dtype.itemsize < out.dtype.itemsize)


def _fp8_residual_epilogue(p: fx.Node, g: Group) -> bool:
    """May fp8 linear `p` take anchorless group `g` as its epilogue: residual adds (and
    casts) over p's own shape, reading p's value directly? Its kernel then adds the
    residual before its one store (templates/fp8_matmul/template.py `epilogue`)."""
    if op_name(p.target) != FP8_LINEAR or not g.members:
        return False
    if not all(op_name(m.target) in _RESIDUAL_OPS for m in g.members):
        return False
    out, root = shape_of(p), shape_of(g.root)
    return (all(u in g.members for u in p.users) and len(out) == len(root)
            and all(same_dim(a, b) for a, b in zip(out, root)))


def _row_epilogue(p: fx.Node, g: Group) -> bool:
    """Is anchorless (pointwise) group `g` a row epilogue of reduction `p`: over p's
    output shape, reading p directly (so each row's value is the kernel's own), p's
    rows static and short enough to be held whole?"""
    out, src = shape_of(p), shape_of(p.args[0])
    root = shape_of(g.root)
    if len(out) != len(root) or not all(same_dim(a, b) for a, b in zip(out, root)):
        return False
    if not all(u in g.members for u in p.users):
        return False
    dims = reduction_dims(op_name(p.target), p.args, p.kwargs, len(src))
    innermost = sorted(dims) == list(range(len(src) - len(dims), len(src)))
    row = 1
    for d in dims:
        if not isinstance(src[d], int):
            return False
        row *= src[d]
    return row <= (ROW_EPILOGUE_MAX if innermost else ROW_EPILOGUE_MAX_STRIDED)


def _over_topk_rows(p: fx.Node, topk: fx.Node) -> bool:
    """Does reduction `p` reduce exactly the rows `topk` picks from (same input shape,
    the topk's axis alone)? Then the topk kernel, which holds those rows whole,
    computes it (a router's softmax)."""
    shape = shape_of(topk.args[0])
    _, dim, _ = topk_args(op_name(topk.target), topk.args, topk.kwargs, len(shape))
    src = shape_of(p.args[0])
    dims = reduction_dims(op_name(p.target), p.args, p.kwargs, len(src))
    return (len(src) == len(shape) and all(same_dim(a, b) for a, b in zip(src, shape))
            and tuple(dims) == (dim % len(shape),))


def generated_topk(node: fx.Node) -> bool:
    """Will codegen write this topk as a kernel of its own (a static row within kiln's
    limits)? Symbolic rows are left to the template, which knows their bounds."""
    shape = shape_of(node.args[0])
    k, dim, _ = topk_args(op_name(node.target), node.args, node.kwargs, len(shape))
    width = shape[dim] if shape else 1
    dtype = node.args[0].meta["val"].dtype
    return isinstance(width, int) and topk_problem(k, width, dtype) is None


def _is_tuple(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), (tuple, list))


def form_groups(graph: fx.Graph, symbols: dict[str, Bounds] | None = None) -> list[Group]:
    """Partition the compute nodes of `graph` into groups, returned in execution order
    (`symbols`: the size symbols' bounds)."""
    group_of: dict[fx.Node, Group] = {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    groups: list[Group] = []
    for p in reversed(list(graph.nodes)):
        if not is_compute(p):
            continue
        consumers, returned = compute_consumers(p)
        targets = {id(group_of[c]): group_of[c] for c in consumers if c in group_of}
        g = next(iter(targets.values())) if len(targets) == 1 else None
        if (g is not None and not returned and all(c in group_of for c in consumers)
                and not _is_tuple(p) and can_join(p, g, consumers, symbols)):
            g.add(p, feeds_anchor=any(u in g.prologue for u in consumers))
        else:
            g = Group(root=p)
            g.add(p, feeds_anchor=False)
            groups.append(g)
        group_of[p] = g
    groups.sort(key=lambda g: order[g.root])
    return groups
