import torch
import torch.nn as nn

from kiln.graph.dce import dce
from kiln.ir.graph import add_node
from tests.graph.util import apply, assert_same_as_eager, graph_of, ops


class Plain(nn.Module):
    def forward(self, x):
        return torch.exp(x) + 1


def test_unused_ops_are_removed_used_ones_kept():
    x = torch.randn(3)
    kg = graph_of(Plain(), x)
    out = kg.output_values()[0]
    dead = add_node(kg, kg.output_node(), torch.ops.aten.neg.default, (out,))
    add_node(kg, kg.output_node(), torch.ops.aten.sin.default, (dead,))
    kg = apply(dce, kg)
    assert ops(kg) == ["aten.exp.default", "aten.add.Tensor"]
    assert_same_as_eager(kg, Plain(), (x,))
