import pytest
import sympy
import torch
import torch.nn as nn
from torch.testing import FileCheck

from kiln.errors import VerifierError
from kiln.graph.collapse_dims import collapse_dims
from kiln.ir.graph import add_node
from kiln.ir.reshape import kind, round_trips
from kiln.ir.symbolic import Bounds, symbol
from kiln.ir.verify import verify
from kiln.pipeline import Context, Pass, PassManager, Stage, as_pass
from tests.graph.util import Dim, apply, assert_same_as_eager, graph_of, ir, ops

aten = torch.ops.aten
RESHAPES = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
            "aten.unsqueeze.default", "aten.squeeze.dim", "aten.squeeze.dims")


class Heads(nn.Module):
    """The attention reshape [T, 64] -> [1, T, 64] -> [1, T, 4, 16], and a round trip."""

    def forward(self, x, y):
        h = (x * 2).view(1, -1, 64).view(1, -1, 4, 16)
        z = y * 3  # [T, 4, 16]
        back = z.reshape(-1, 64).reshape(-1, 4, 16).reshape(-1, 64)  # collapse-expand-collapse
        same = h.view(-1, 64).view(1, -1, 4, 16)  # back to h's own shape
        return h.permute(0, 2, 1, 3) + same.permute(0, 2, 1, 3), back + 1


def test_chains_become_one_reshape():
    x, y = torch.randn(5, 64), torch.randn(5, 4, 16)
    T = Dim("T", min=1)
    kg = graph_of(Heads(), x, y, dynamic=({0: T}, {0: T}))
    assert round_trips(kg.graph)  # the input has one
    kg = apply(collapse_dims, kg)
    assert not round_trips(kg.graph)
    for n in kg.graph.nodes:
        if n.op == "call_function" and str(n.target) in RESHAPES:
            assert str(n.args[0].target) not in RESHAPES, f"%{n.name} reads a reshape"
    sym = next(iter(kg.symbols))
    text = ir(kg)
    FileCheck().check_count(f"f32[1, {sym}, 4, 16] = aten.view.default(%mul, ", 2,
                            exactly=True).run(text)
    round_trip = kg.output_values()[1].args[0]  # now one view of y * 3
    assert str(round_trip.target) == "aten.view.default" and round_trip.args[0].args[0].name == "y"
    FileCheck().check_count("aten.view.default", 3, exactly=True).run(text)
    assert_same_as_eager(kg, Heads(), (x, y), (torch.randn(9, 64), torch.randn(9, 4, 16)))


class UnitDims(nn.Module):
    def forward(self, x):
        return (x + 1).unsqueeze(0).view(1, -1, 2, 4).squeeze(0).unsqueeze(-1)


def test_unsqueeze_and_squeeze_join_the_chain():
    x = torch.randn(3, 8)
    kg = apply(collapse_dims, graph_of(UnitDims(), x, dynamic=({0: Dim("T", min=2)},)))
    reshapes = [o for o in ops(kg) if o in RESHAPES]
    assert reshapes == ["aten.view.default"], ir(kg)
    sym = next(iter(kg.symbols))
    FileCheck().check(f"aten.view.default(%add, [{sym}, 2, 4, 1])").run(ir(kg))
    assert_same_as_eager(kg, UnitDims(), (x,), (torch.randn(6, 8),))


class Identity(nn.Module):
    def forward(self, x):
        return (x + 1).view(-1).view(x.shape[0], 3, 4).view(x.shape) * 2


def test_chain_back_to_the_source_shape_disappears():
    x = torch.randn(2, 12)
    kg = apply(collapse_dims, graph_of(Identity(), x, dynamic=({0: Dim("B", min=1)},)))
    assert [o for o in ops(kg) if o in RESHAPES] == []
    assert_same_as_eager(kg, Identity(), (x,), (torch.randn(4, 12),))


class Plain(nn.Module):
    def forward(self, x):
        return x + 1


@as_pass(name="bad_round_trip")
def bad_round_trip(kg, ctx):
    """A deliberately wrong pass: splits the output into [B, 3, 4] and merges it back."""
    out = kg.output_values()[0]
    b = kg.placeholders()["x"]
    size = add_node(kg, kg.output_node(), aten.sym_size.int, (b, 0))
    flat = add_node(kg, kg.output_node(), aten.view.default, (out, [size, 12]))
    split = add_node(kg, kg.output_node(), aten.view.default, (flat, [size, 3, 4]))
    merged = add_node(kg, kg.output_node(), aten.view.default, (split, [size, 12]))
    kg.output_node().args = ([merged],)
    return kg


# collapse_dims establishes two invariants; this pass promises only the round-trip one, so
# the round trip below is reported by its own check (the reshape-chain check sorts first
# and would otherwise report the same chain).
round_trips_only = Pass("collapse_dims", collapse_dims.fn, ("no-reshape-round-trip",))


def test_verifier_names_the_pass_that_reintroduces_a_round_trip():
    x = torch.randn(2, 3, 4)
    kg = graph_of(Plain(), x, dynamic=({0: Dim("B", min=1)},))
    pm = PassManager([Stage("graph", [round_trips_only, bad_round_trip])])
    with pytest.raises(VerifierError, match="graph/bad_round_trip") as err:
        pm.run(kg, Context(target=None))
    merged = kg.output_values()[0]
    split, flat = merged.args[0], merged.args[0].args[0]
    trip = f"collapse -> expand -> collapse round trip %{flat} -> %{split} -> %{merged}"
    assert f"graph/bad_round_trip: {trip}" in str(err.value)
    assert round_trips(kg.graph) == verify(kg, {"no-reshape-round-trip"}) != []


def test_collapse_dims_reports_the_first_broken_invariant_of_a_round_trip():
    """With collapse_dims' own pair of invariants the chain check comes first, and the
    pass that broke it is still named."""
    kg = graph_of(Plain(), torch.randn(2, 3, 4), dynamic=({0: Dim("B", min=1)},))
    pm = PassManager([Stage("graph", [collapse_dims, bad_round_trip])])
    with pytest.raises(VerifierError, match="graph/bad_round_trip") as err:
        pm.run(kg, Context(target=None))
    split = kg.output_values()[0].args[0]
    assert f"%{split} reshapes the reshape %{split.args[0]}; chains must be composed" in str(
        err.value)


def test_reshape_kinds_with_symbolic_sizes_and_bounds():
    s = symbol("s0")
    assert kind([s, 4, 16], [s, 64]) == "collapse"
    assert kind([s, 64], [1, s, 4, 16]) == "expand"
    assert kind([s, 64], [1, s, 64, 1]) == "unit"
    assert kind([s, 64], [s, 64]) == "identity"
    assert kind([2, s, 3], [3, s, 2]) == "mixed"
    # Which of s and 64 is smaller decides how dims pair up: the bounds can tell...
    assert kind([s, 64], [64, s], {"s0": Bounds(1, 32)}) == "mixed"
    assert kind([s, 2, 32], [s, 64], {"s0": Bounds(1, 32)}) == "collapse"
    # ...an unbounded s cannot, and the answer falls back to "mixed", never an error.
    t = sympy.Symbol("t0", integer=True, positive=True)
    assert kind([s, t], [t * s], {"s0": Bounds(1, None)}) == "collapse"
    assert kind([s, t], [t, s], {"s0": Bounds(1, None), "t0": Bounds(1, None)}) == "mixed"
