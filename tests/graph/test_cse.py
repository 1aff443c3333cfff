import torch
import torch.nn as nn
from torch.testing import FileCheck

from kiln.graph.cse import cse
from tests.graph.util import Dim, apply, assert_same_as_eager, graph_of, ir, ops


class Projections(nn.Module):
    """Three projections of one input: export writes view(x, [T, 8]) once per Linear."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) * self.v(x)


def test_repeated_views_merge():
    x = torch.randn(1, 5, 8)
    m = Projections()
    kg = graph_of(m, x, dynamic=({1: Dim("T", min=1)},))
    assert ops(kg).count("aten.view.default") == 6
    kg = apply(cse, kg)
    # One view of x feeds all three matmuls; the three views back differ in source.
    assert ops(kg).count("aten.view.default") == 4
    FileCheck().check_count("aten.mm.default(%view,", 3, exactly=True).run(ir(kg))
    assert_same_as_eager(kg, m, (x,), (torch.randn(1, 3, 8),))


class Repeats(nn.Module):
    def forward(self, x):
        a = torch.exp(x) + torch.exp(x)
        b = x * 2 + x * 2.0  # int 2 and float 2.0 are different arguments
        c = x.sum(-1, keepdim=True) - x.sum(-1, keepdim=False).unsqueeze(-1)
        return a, b, c


def test_merges_equal_ops_only():
    x = torch.randn(3, 4)
    kg = apply(cse, graph_of(Repeats(), x))
    names = ops(kg)
    assert names.count("aten.exp.default") == 1
    assert names.count("aten.mul.Tensor") == 2
    assert names.count("aten.sum.dim_IntList") == 2  # keepdim differs
    assert_same_as_eager(kg, Repeats(), (x,))


class Random(nn.Module):
    def forward(self, x):
        return x + torch.rand(4), x + torch.rand(4)


def test_random_ops_are_never_merged():
    kg = apply(cse, graph_of(Random(), torch.randn(4)))
    assert ops(kg).count("aten.rand.default") == 2
