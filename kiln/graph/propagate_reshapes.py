"""Reshape / transpose propagation: compose permutes, cancel inverse pairs, and move
permutes and reshapes through elementwise ops when that makes pairs cancel.

Rewrites, to a fixed point:
- permute(permute(x, p), q) -> permute(x, p then q); an identity permute disappears.
- an elementwise region (connected elementwise ops of one shape) whose every entry
  is permute(a_i, p) (rank-0 tensors and scalars aside) and whose every exit is a
  permute: the region runs on the a_i and each exit composes p with its own perm, so
  `permute(f(permute(a, p), permute(b, p)), inverse of p)` becomes `f(a, b)`.
- the same for reshapes: entries all reshape one shape S0 to the region's shape,
  every exit is a reshape; the region runs at S0 and each exit reshapes its result
  (and disappears when it reshapes back to S0): the view pair around an activation
  between two matmul regions goes away.
A move needs every entry and every exit to be a view of that kind, so it never adds
a view. No broadcasting inside a region (every op has the entries' shape), and
shapes are compared symbolically, so a move holds for every size of a dynamic dim.

Assumes canonical views (canonicalize ran: transposes are permutes). Runs before
collapse_dims, which composes the reshape chains these moves leave behind.
"""

from __future__ import annotations

import torch.fx as fx

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.rewrite import (
    aten,
    category_of,
    erase_if_dead,
    insert,
    is_tensor,
    name_of,
    rank,
    replace,
    reshape_sizes,
    reshape_to,
    same_shape,
)
from kiln.ir.graph import KilnGraph, shape_of
from kiln.ir.ops import SHAPE_ONLY_OPS, OpCategory, norm_axis
from kiln.pipeline import as_pass

PERMUTE = "aten.permute.default"
# Pointwise-category ops that are not elementwise functions of their operands.
_NOT_ELEMENTWISE = {"aten.copy.default"}
# Rounds of rewriting before giving up on a fixed point (each round moves views down).
MAX_ROUNDS = 64
# The most elementwise ops one move rewrites (bounds the search around each view).
MAX_REGION = 256


def perm_of(node: fx.Node) -> list[int]:
    return [norm_axis(d, rank(node)) for d in node.args[1]]


def compose_permutes(kg: KilnGraph, node: fx.Node) -> bool:
    """permute(permute(x, p), q) -> permute(x, [p[i] for i in q]); identity -> x."""
    if name_of(node) != PERMUTE:
        return False
    src = node.args[0]
    if name_of(src) == PERMUTE:
        p, q = perm_of(src), perm_of(node)
        new_perm = [p[i] for i in q]
        x = src.args[0]
    else:
        new_perm, x = perm_of(node), src
    if new_perm == list(range(len(new_perm))):
        replace(node, x)
    elif x is src:
        return False
    else:
        replace(node, insert(kg, node, aten.permute.default, (x, new_perm), like=node))
    erase_if_dead(src)
    return True


def _elementwise(node) -> bool:
    return (category_of(node) == OpCategory.POINTWISE and is_tensor(node)
            and name_of(node) not in _NOT_ELEMENTWISE)


def _operands(node: fx.Node) -> list[fx.Node]:
    """Tensor operands that take part elementwise (rank-0 tensors broadcast anywhere)."""
    return [a for a in node.all_input_nodes if is_tensor(a) and rank(a) > 0]


class _ViewKind:
    """What a region's entries and exits are: permutes by one perm, or reshapes from one
    shape. `seed` is an entry; an entry's source is what the region will compute on."""

    def __init__(self, seed: fx.Node):
        self.seed = seed
        self.is_permute = name_of(seed) == PERMUTE
        self.perm = perm_of(seed) if self.is_permute else None
        self.source_shape = shape_of(seed.args[0])

    def is_entry(self, a: fx.Node) -> bool:
        if not same_shape(a, self.seed):
            return False
        if self.is_permute:
            return name_of(a) == PERMUTE and perm_of(a) == self.perm
        return name_of(a) in SHAPE_ONLY_OPS and same_shape(a.args[0], self.source_shape)

    def is_exit(self, u: fx.Node) -> bool:
        return name_of(u) == PERMUTE if self.is_permute else name_of(u) in SHAPE_ONLY_OPS


def elementwise_region(seed: fx.Node, kind: _ViewKind) -> set[fx.Node] | None:
    """The elementwise ops around `seed`'s users that read only entries (and each
    other), all of the entries' shape, whose results only exits read. None if the
    region has any other edge to the rest of the graph."""
    region: set[fx.Node] = set()
    stack = [u for u in seed.users if not kind.is_exit(u)]
    while stack:
        n = stack.pop()
        if n in region:
            continue
        if not _elementwise(n) or not same_shape(n, seed) or len(region) >= MAX_REGION:
            return None
        region.add(n)
        for a in _operands(n):
            if a not in region and not kind.is_entry(a):
                stack.append(a)  # must join the region too (checked when popped)
        for u in n.users:
            if not kind.is_exit(u):
                stack.append(u)
    return region or None


def move_views_through(kg: KilnGraph, seed: fx.Node) -> bool:
    """Run an elementwise region on its entries' sources; its exits compose with the
    entry view (and vanish when they undo it)."""
    kind = _ViewKind(seed)
    region = elementwise_region(seed, kind)
    if region is None:
        return False
    exits = [u for n in region for u in n.users if u not in region]
    sizes = {}
    if not kind.is_permute:
        for u in exits:
            if not same_shape(u, kind.source_shape):
                sizes[u] = reshape_sizes(kg, u)
                if sizes[u] is None:
                    return False
    new: dict[fx.Node, fx.Node] = {}
    for n in [n for n in kg.graph.nodes if n in region]:  # in graph order
        def source(a):
            if a in new:
                return new[a]
            return a.args[0] if kind.is_entry(a) else a
        args = fx.node.map_arg(n.args, source)
        kwargs = fx.node.map_arg(n.kwargs, source)
        new[n] = insert(kg, n, n.target, args, kwargs, like=n)
    for u in exits:
        inner = new[u.args[0]]
        if kind.is_permute:
            perm = [kind.perm[i] for i in perm_of(u)]
            out = inner if perm == list(range(len(perm))) else insert(
                kg, u, aten.permute.default, (inner, perm), like=u)
        else:
            out = inner if u not in sizes else reshape_to(kg, inner, u, sizes[u])
        replace(u, out)
    for n in reversed([n for n in kg.graph.nodes if n in region]):
        erase_if_dead(n)  # (and the entries only the region read)
    return True


def _seeds(node: fx.Node) -> bool:
    return (name_of(node) == PERMUTE or name_of(node) in SHAPE_ONLY_OPS) and any(
        _elementwise(u) for u in node.users)


def propagate(kg: KilnGraph) -> int:
    total = 0
    for _ in range(MAX_ROUNDS):
        changed = False
        for node in list(kg.graph.nodes):
            if node.op != "call_function" or node._erased:
                continue
            if compose_permutes(kg, node) or (_seeds(node) and move_views_through(kg, node)):
                changed = True
                total += 1
        if not changed:
            break
    return total


@as_pass
def propagate_reshapes(kg: KilnGraph, ctx) -> KilnGraph:
    if propagate(kg):
        eliminate_dead_code(kg)
        kg.recompile()
    return kg

