import torch
import torch.nn as nn
from torch.export import Dim

from kiln.frontend.export import import_model
from kiln.ir.symbolic import is_static
from kiln.ir.verify import GRAPH_INVARIANTS, verify


class Transpose(nn.Module):
    def forward(self, x):
        return x.t() * 2


def test_verifying_never_specialises_a_dynamic_dim():
    """x is [N, 2] with example N = 2: comparing the permute's [2, N] with x's [N, 2]
    as torch SymInts would guard N == 2 and make the graph static."""
    kg = import_model(Transpose(), (torch.randn(2, 2),),
                      dynamic_shapes=({0: Dim("N", min=2, max=16)},))
    assert verify(kg, set(GRAPH_INVARIANTS)) == []
    x = kg.placeholders()["x"]
    assert not is_static(x.meta["val"].shape[0].node.expr)
    assert not kg.fake_mode().shape_env.replacements
