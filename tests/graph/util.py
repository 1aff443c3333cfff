"""Helpers for graph-pass tests: import a tiny module, run a pass, read or run the graph."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.export import Dim

from kiln.frontend.export import import_model
from kiln.ir.graph import KilnGraph
from kiln.ir.ops import op_name
from kiln.ir.printer import print_graph
from kiln.ir.verify import verify
from kiln.pipeline import Context
from tests.helpers import assert_close_tree

__all__ = ["Dim", "apply", "graph_of", "ir", "ops", "run_graph", "assert_same_as_eager"]


def graph_of(module: torch.nn.Module, *args, dynamic=None) -> KilnGraph:
    return import_model(module, args, dynamic_shapes=dynamic)


def apply(pass_, kg: KilnGraph, invariants=()) -> KilnGraph:
    """Run one pass as the pipeline would, then check structure and `invariants`."""
    kg = pass_(kg, Context(target=None))
    problems = verify(kg, set(invariants) | set(pass_.establishes))
    assert not problems, problems
    return kg


def ir(kg: KilnGraph) -> str:
    return print_graph(kg)


def ops(kg: KilnGraph) -> list[str]:
    return [op_name(n.target) for n in kg.graph.nodes if n.op == "call_function"]


class _ValueInterpreter(fx.Interpreter):
    """Runs a KilnGraph's ops eagerly; a view is a logical reshape, as in kiln."""

    def call_function(self, target, args, kwargs):
        if target in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default):
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)


def run_graph(kg: KilnGraph, *user_args) -> list:
    """The graph's user outputs for these arguments (state comes from kg.state)."""
    state = {k: v.clone() for k, v in kg.state.items()}
    user = iter(user_args)
    feeds = []
    for spec in kg.inputs:
        if spec.kind == "user":
            feeds.append(next(user))
        elif spec.kind == "user_const":
            feeds.append(spec.value)
        else:
            feeds.append(state[spec.target])
    with torch.no_grad():
        outs = _ValueInterpreter(kg.module).run(*feeds)
    return [o for o, spec in zip(outs, kg.outputs) if spec.kind == "user"]


def assert_same_as_eager(kg: KilnGraph, module, *arg_sets, tol: float = 1e-6) -> None:
    """The (rewritten) graph computes what the module does, on every argument set."""
    for args in arg_sets:
        ref = module(*args)
        ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        assert_close_tree(run_graph(kg, *args), ref, tol)
