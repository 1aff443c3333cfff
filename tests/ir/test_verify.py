import pytest
import torch
import torch.nn as nn
from torch.export import Dim

from kiln.errors import VerifierError
from kiln.frontend.export import import_model
from kiln.ir.symbolic import is_static
from kiln.ir.verify import GRAPH_INVARIANTS, verify
from kiln.pipeline import Pass


class Transpose(nn.Module):
    def forward(self, x):
        return x.t() * 2


def test_verifying_never_specialises_a_dynamic_dim():
    """x is [N, 2] with example N = 2: comparing the permute's [2, N] with x's [N, 2]
    as torch SymInts would guard N == 2 and make the graph static."""
    kg = import_model(Transpose(), (torch.randn(2, 2),),
                      dynamic_shapes=({0: Dim("N", min=2, max=16)},))
    assert verify(kg, set(GRAPH_INVARIANTS) - {"devices-assigned"}) == []  # not yet placed
    x = kg.placeholders()["x"]
    assert not is_static(x.meta["val"].shape[0].node.expr)
    assert not kg.fake_mode().shape_env.replacements


def test_an_unknown_invariant_is_an_error_not_a_skip():
    kg = import_model(Transpose(), (torch.randn(2, 2),))
    with pytest.raises(VerifierError, match="unknown IR invariant 'no-reshape-chain'") as err:
        verify(kg, {"no-reshape-chain"})  # typo of no-reshape-chains
    assert "no-reshape-chains" in err.value.hint and "devices-assigned" in err.value.hint


def test_a_pass_establishing_an_unknown_invariant_fails_when_defined():
    with pytest.raises(VerifierError, match="unknown IR invariant 'no-dead-cod'") as err:
        Pass("dce_typo", lambda ir, ctx: ir, establishes=("no-dead-code", "no-dead-cod"))
    assert err.value.where == "pass dce_typo"
    assert Pass("dce", lambda ir, ctx: ir, establishes=tuple(GRAPH_INVARIANTS)).establishes


def test_devices_assigned_names_the_node_without_a_device():
    kg = import_model(Transpose(), (torch.randn(2, 2),))
    for n in kg.graph.nodes:
        n.meta["device"] = 0
    assert verify(kg, {"devices-assigned"}) == []
    mul = next(n for n in kg.graph.nodes if "mul" in n.name)
    del mul.meta["device"]
    assert verify(kg, {"devices-assigned"}) == [f"%{mul.name} has no device assigned"]
