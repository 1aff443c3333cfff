import torch
import torch.nn as nn
from torch.testing import FileCheck

from kiln.graph.propagate_reshapes import propagate_reshapes
from tests.graph.util import Dim, apply, assert_same_as_eager, graph_of, ir, ops

PERMUTE = "aten.permute.default"


class PermutePairs(nn.Module):
    def forward(self, x):
        a = x.permute(0, 2, 1, 3).permute(0, 2, 1, 3)  # inverse pair
        b = x.permute(1, 0, 2, 3).permute(0, 2, 3, 1)  # composes to one permute
        return a * 2, b + 1


def test_permutes_compose_and_inverse_pairs_cancel():
    x = torch.randn(1, 5, 4, 8)
    kg = apply(propagate_reshapes, graph_of(PermutePairs(), x, dynamic=({1: Dim("T", min=1)},)))
    assert ops(kg).count(PERMUTE) == 1
    text = ir(kg)
    FileCheck().check("aten.mul.Tensor(%x, 2)").run(text)
    FileCheck().check("aten.permute.default(%x, [1, 2, 3, 0])").run(text)
    assert_same_as_eager(kg, PermutePairs(), (x,), (torch.randn(1, 3, 4, 8),))


class ThroughElementwise(nn.Module):
    """Heads split off, scaled and added, then merged back: the permutes cancel."""

    def forward(self, x, y):
        q = x.permute(0, 2, 1, 3)
        k = y.permute(0, 2, 1, 3)
        s = torch.sigmoid(q * 0.5 + k)
        return s.permute(0, 2, 1, 3) * 3


def test_permutes_move_through_elementwise_ops_and_cancel():
    x, y = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 2, 4)
    T = Dim("T", min=1)
    kg = apply(propagate_reshapes, graph_of(ThroughElementwise(), x, y,
                                            dynamic=({1: T}, {1: T})))
    assert PERMUTE not in ops(kg), ir(kg)
    assert_same_as_eager(kg, ThroughElementwise(), (x, y), (torch.randn(1, 3, 2, 4),
                                                            torch.randn(1, 3, 2, 4)))


class ReshapeSandwich(nn.Module):
    """An activation between a view and its inverse (as between two matmul regions)."""

    def forward(self, x):
        h = x.view(1, -1, 16)
        return torch.nn.functional.gelu(h * 2).view(-1, 16) + 1


def test_reshapes_move_through_elementwise_ops_and_cancel():
    x = torch.randn(5, 16)
    kg = apply(propagate_reshapes, graph_of(ReshapeSandwich(), x,
                                            dynamic=({0: Dim("T", min=1)},)))
    assert "aten.view.default" not in ops(kg), ir(kg)
    assert_same_as_eager(kg, ReshapeSandwich(), (x,), (torch.randn(2, 16),))


class NoGain(nn.Module):
    def forward(self, x, y):
        p = x.permute(1, 0)
        return torch.exp(p) + y, torch.exp(p).permute(1, 0)  # one user is not a permute


def test_no_move_without_a_cancellation():
    x, y = torch.randn(3, 4), torch.randn(4, 3)
    before = graph_of(NoGain(), x, y)
    n_before = ops(before).count(PERMUTE)
    kg = apply(propagate_reshapes, before)
    assert ops(kg).count(PERMUTE) <= n_before
    FileCheck().check("aten.exp.default(%permute").run(ir(kg))
    assert_same_as_eager(kg, NoGain(), (x, y))


class Broadcasting(nn.Module):
    """A broadcast operand (cos of shape [T, D]) blocks the move: semantics first."""

    def forward(self, x, cos):
        q = x.permute(0, 2, 1, 3)
        return (q * cos).permute(0, 2, 1, 3)


def test_broadcast_operands_block_the_move():
    x, cos = torch.randn(1, 5, 2, 4), torch.randn(5, 4)
    T = Dim("T", min=1)
    kg = apply(propagate_reshapes, graph_of(Broadcasting(), x, cos, dynamic=({1: T}, {0: T})))
    assert ops(kg).count(PERMUTE) == 2
    assert_same_as_eager(kg, Broadcasting(), (x, cos), (torch.randn(1, 3, 2, 4),
                                                        torch.randn(3, 4)))
