"""Fold constants: compute at compile time what depends only on weights.

A node is constant when every tensor it reads is a weight (a parameter, a buffer the
model never updates, a lifted constant) or another constant node, and its op is
deterministic. A CREATE op (arange, full) with a static shape counts as constant.
Each constant value the runtime still needs is computed once here and becomes a new
placeholder of kind "constant" with a state entry (`KilnGraph.state`), so it is
stored and loaded like any weight.

Folding happens at the last compute op before the runtime needs the value: views
are never folded on their own (they cost nothing at run time), and a subgraph made
only of CREATE ops is left to be recomputed (an iota is cheaper than a load). A
value is folded only when it is no larger than the weights it reads: reading it
then costs no more bandwidth than computing it, and the copy it adds to memory is
bounded by the weights themselves (a broadcast of a bias to every row is not).

Weights that only folded subgraphs read leave the graph. Never folds a node that
reads a mutable buffer (`KilnGraph.mutable`) or a user input. Assumes weights have
static shapes (they are real tensors); weights on the meta device are not folded.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from kiln.graph.dce import eliminate_dead_code
from kiln.graph.rewrite import category_of, is_sym, is_tensor, name_of
from kiln.ir.derived import Derivation
from kiln.ir.graph import GraphInput, KilnGraph
from kiln.ir.ops import IMPURE_OPS, STRICT_VIEWS, OpCategory, resolve
from kiln.ir.symbolic import as_dim, is_static
from kiln.pipeline import as_pass

log = logging.getLogger("kiln.graph")

# Folded state entries are named under this prefix, after the node they replace.
STATE_PREFIX = "kiln_folded."
# The largest folded value, as a multiple of the bytes of the weights it reads.
MAX_GROWTH = 1.0
_NOT_FOLDABLE = {OpCategory.SCATTER, OpCategory.EXTERN}


def constant_placeholders(kg: KilnGraph) -> dict[fx.Node, torch.Tensor]:
    """Placeholders holding weights the model never changes, with their tensors; not
    those on the meta device, whose values do not exist yet (a model compiled before
    its weights are read, as each rank of a multi-device plan reads only its slices):
    what they compute stays in the graph and runs on the weights read later."""
    spec = {i.name: i for i in kg.inputs}
    out = {}
    for node in kg.graph.nodes:
        if node.op != "placeholder":
            continue
        i = spec[node.name]
        if i.kind in ("param", "buffer", "constant") and i.target not in kg.mutable:
            t = kg.state.get(i.target)
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                out[node] = t
    return out


def note_values_read(kg: KilnGraph, nodes) -> None:
    """Record that the plan follows from these placeholders' values (a rewrite decided
    by them, nothing folded): a compile cache hit checks them (KilnGraph.values_read)."""
    targets = {i.name: i.target for i in kg.inputs}
    kg.values_read.update(targets[n.name] for n in nodes if n.name in targets)


def _static(node: fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return all(isinstance(v, torch.Tensor) and all(is_static(as_dim(d)) for d in v.shape)
               for v in vals)


def constant_nodes(kg: KilnGraph, weights: dict[fx.Node, torch.Tensor]) -> dict[fx.Node, bool]:
    """Constant call nodes -> whether they read a weight (transitively)."""
    const: dict[fx.Node, bool] = {}
    for node in kg.graph.nodes:
        if node.op != "call_function" or name_of(node) in IMPURE_OPS or not _static(node):
            continue
        if category_of(node) in _NOT_FOLDABLE or category_of(node) is None:
            continue
        inputs = node.all_input_nodes
        if any(is_sym(a) for a in inputs):
            continue
        if all(a in weights or a in const for a in inputs):
            const[node] = any(a in weights or const[a] for a in inputs)
    return const


def _worth_folding(node: fx.Node, const: dict[fx.Node, bool],
                   weights: dict[fx.Node, torch.Tensor]) -> bool:
    """A compute op on weights whose value is no larger than the weights it reads."""
    if not const[node] or not is_tensor(node):
        return False
    if category_of(node) in (OpCategory.VIEW, OpCategory.CREATE):
        return False
    if category_of(node) == OpCategory.TUPLE and category_of(node.args[0]) == OpCategory.VIEW:
        return False
    read = _weights_read(node, weights)
    size = node.meta["val"].numel() * node.meta["val"].element_size()
    return size <= MAX_GROWTH * sum(t.numel() * t.element_size() for t in read)


def _weights_read(node: fx.Node, weights) -> list[torch.Tensor]:
    seen, stack, out = set(), [node], []
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in weights:
            out.append(weights[n])
        else:
            stack.extend(n.all_input_nodes)
    return out


def choose_folds(kg: KilnGraph, const, weights) -> list[fx.Node]:
    """Constant nodes to materialise: those the runtime needs that are worth folding.

    Users come before producers in the reverse walk, so each node knows whether a
    runtime (non-folded) node still reads it.
    """
    runtime_needs: set[fx.Node] = set()
    folds: list[fx.Node] = []
    for node in reversed(list(kg.graph.nodes)):
        if node not in const:
            continue
        needed = any(u not in const or u in runtime_needs for u in node.users)
        if not needed:
            continue
        if _worth_folding(node, const, weights):
            folds.append(node)
        else:
            runtime_needs.add(node)
    return folds[::-1]


def evaluate(nodes: list[fx.Node], weights) -> dict[fx.Node, torch.Tensor]:
    """Run the constant subgraph behind `nodes` on the real weights."""
    values: dict[fx.Node, object] = dict(weights)

    def run(n: fx.Node):
        if n in values:
            return values[n]
        for a in n.all_input_nodes:
            run(a)
        args = fx.node.map_arg(n.args, values.__getitem__)
        kwargs = fx.node.map_arg(n.kwargs, values.__getitem__)
        target = n.target
        if name_of(n) in STRICT_VIEWS:
            target = resolve("aten.reshape.default")
        values[n] = target(*args, **kwargs)
        return values[n]

    with torch.no_grad():
        return {n: run(n).contiguous() for n in nodes}


def add_constant(kg: KilnGraph, node: fx.Node, value: torch.Tensor,
                 derivation: Derivation | None = None) -> fx.Node:
    """A new "constant" placeholder for `value`, after the existing weights; `derivation`:
    how `value` follows from one model tensor, recorded for the compile cache."""
    key = STATE_PREFIX + node.name
    kg.state[key] = value
    if derivation is not None:
        kg.derived[key] = derivation
    user_kinds = ("user", "user_const", "user_size")
    index = next((i for i, s in enumerate(kg.inputs) if s.kind in user_kinds), len(kg.inputs))
    placeholders = [n for n in kg.graph.nodes if n.op == "placeholder"]
    if index < len(placeholders):
        ctx = kg.graph.inserting_before(placeholders[index])
    else:
        ctx = kg.graph.inserting_after(placeholders[-1]) if placeholders else \
            kg.graph.inserting_before(None)
    with ctx:
        ph = kg.graph.placeholder(f"folded_{node.name}")
    with kg.fake_mode():
        ph.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)
    if "stack_trace" in node.meta:
        ph.meta["stack_trace"] = node.meta["stack_trace"]
    kg.inputs.insert(index, GraphInput(ph.name, "constant", key))
    return ph


def fold_graph(kg: KilnGraph) -> int:
    weights = constant_placeholders(kg)
    const = constant_nodes(kg, weights)
    folds = choose_folds(kg, const, weights)
    if not folds:
        return 0
    values = evaluate(folds, weights)
    for node in folds:
        ph = add_constant(kg, node, values[node])
        node.replace_all_uses_with(ph)
        log.info("folded %%%s into constant %s %s", node.name, ph.name, list(values[node].shape))
    eliminate_dead_code(kg)
    drop_unread(kg, weights)
    return len(folds)


def drop_unread(kg: KilnGraph, weights: dict[fx.Node, torch.Tensor]) -> None:
    """Weights only the folded subgraphs read leave the graph, so the plan (and a GPU)
    never holds them. Their state entries stay: the model still owns them."""
    for node in weights:
        if not node.users:
            kg.inputs = [i for i in kg.inputs if i.name != node.name]
            kg.graph.erase_node(node)


@as_pass
def fold_constants(kg: KilnGraph, ctx) -> KilnGraph:
    if fold_graph(kg):
        kg.recompile()
    return kg
