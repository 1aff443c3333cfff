import operator

import torch
import torch.nn as nn
from torch.testing import FileCheck

from kiln.graph.canonicalize import canonicalize
from kiln.ir.graph import add_node
from tests.graph.util import Dim, apply, assert_same_as_eager, graph_of, ir, ops

aten = torch.ops.aten


class Chunk(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return a * b, torch.cat((-b, a), dim=-1)


def test_chunk_becomes_slices():
    x = torch.randn(3, 8)
    kg = apply(canonicalize, graph_of(Chunk(), x, dynamic=({0: Dim("T", min=1)},)))
    text = ir(kg)
    FileCheck().check_not("split_with_sizes").check_not("getitem").run(text)
    FileCheck().check("aten.slice.Tensor(%x, 1, 0, 4)").check(
        "aten.slice.Tensor(%x, 1, 4, 8)").run(text)
    assert_same_as_eager(kg, Chunk(), (x,), (torch.randn(5, 8),))


class SymbolicSplit(nn.Module):
    def forward(self, x):
        head, rest = torch.split(x, [2, x.shape[0] - 2])
        return head.sum(0), rest * 3


def test_split_with_symbolic_sizes_reads_the_size():
    x = torch.randn(6, 4)
    kg = apply(canonicalize, graph_of(SymbolicSplit(), x, dynamic=({0: Dim("T", min=4)},)))
    sym = next(iter(kg.symbols))
    FileCheck().check("aten.slice.Tensor(%x, 0, 0, 2)").check(
        f"aten.slice.Tensor(%x, 0, 2, {sym})").run(ir(kg))
    assert "aten.split_with_sizes.default" not in ops(kg)
    assert_same_as_eager(kg, SymbolicSplit(), (x,), (torch.randn(9, 4),))


class Identities(nn.Module):
    def forward(self, x, n):
        a = x.clone().detach()
        b = a.to(torch.float32).reshape(x.shape).expand(x.shape)
        c = (b * 1 + 0) / 1 - 0
        d = -(-c) ** 1
        return d + x[:, :], n * 1


def test_identities_removed():
    x, n = torch.randn(3, 5), torch.randint(0, 9, (3, 5))
    kg = apply(canonicalize, graph_of(Identities(), x, n, dynamic=({0: Dim("T")}, {0: Dim("T")})))
    # Only the final add remains: every other op computes nothing.
    assert ops(kg) == ["aten.add.Tensor"], ir(kg)
    assert_same_as_eager(kg, Identities(), (x, n), (torch.randn(7, 5), torch.randint(0, 9, (7, 5))))


class NotIdentities(nn.Module):
    def forward(self, x, m):
        # a cast, a dtype-changing *1, a broadcasting +0 and a partial slice all compute
        return x.half(), m * 1, x + torch.zeros(4, 1, 1), x[:, 1:], x.reshape(-1)


def test_non_identities_kept():
    x, m = torch.randn(2, 3), torch.rand(2, 3) > 0.5
    kg = apply(canonicalize, graph_of(NotIdentities(), x, m))
    names = ops(kg)
    for op in ("aten._to_copy.default", "aten.mul.Tensor", "aten.add.Tensor",
               "aten.slice.Tensor", "aten.view.default"):
        assert op in names, (op, names)
    assert_same_as_eager(kg, NotIdentities(), (x, m))


class Plain(nn.Module):
    def forward(self, x):
        return x + 1


def _with_node(kg, target, args):
    """Route the graph's output through a hand-made `target(x, *args)` node."""
    out = kg.output_values()[0]
    node = add_node(kg, kg.output_node(), target, (out, *args))
    kg.output_node().args = ([node],)
    return kg


def test_transpose_and_t_become_permute():
    x = torch.randn(2, 3, 4)
    kg = _with_node(graph_of(Plain(), x), aten.transpose.int, (-1, 0))
    kg = apply(canonicalize, kg)
    FileCheck().check("aten.permute.default(%add, [2, 1, 0])").check_not("transpose").run(ir(kg))
    assert_same_as_eager(kg, lambda x: (x + 1).transpose(-1, 0), (x,))

    y = torch.randn(5, 6)
    kg = _with_node(graph_of(Plain(), y), aten.t.default, ())
    kg = apply(canonicalize, kg)
    FileCheck().check("aten.permute.default(%add, [1, 0])").check_not("aten.t.").run(ir(kg))
    assert_same_as_eager(kg, lambda y: (y + 1).t(), (y,))


def test_unbind_becomes_select():
    x = torch.randn(3, 4)
    kg = graph_of(Plain(), x)
    out = kg.output_values()[0]
    unbind = add_node(kg, kg.output_node(), aten.unbind.int, (out, 1))
    parts = [add_node(kg, kg.output_node(), operator.getitem, (unbind, i)) for i in (3, 0)]
    total = add_node(kg, kg.output_node(), aten.sub.Tensor, tuple(parts))
    kg.output_node().args = ([total],)
    kg = apply(canonicalize, kg)
    FileCheck().check("aten.select.int(%add, 1, 3)").check("aten.select.int(%add, 1, 0)").run(
        ir(kg))
    assert "aten.unbind.int" not in ops(kg)
    assert_same_as_eager(kg, lambda x: (x + 1)[:, 3] - (x + 1)[:, 0], (x,))


class Views(nn.Module):
    def forward(self, x):
        a = x.reshape(-1, 4)  # export: view(x, [-1, 4])
        b = x.view(x.shape[0] * 2, 4)
        return a + 1, b * 2


def test_views_spell_out_their_sizes():
    x = torch.randn(3, 8)
    kg = apply(canonicalize, graph_of(Views(), x, dynamic=({0: Dim("T", min=1)},)))
    sym = next(iter(kg.symbols))
    text = ir(kg)
    assert "-1" not in text
    FileCheck().check_count(f"aten.view.default(%x, [2*{sym}, 4])", 2, exactly=True).run(text)
    assert_same_as_eager(kg, Views(), (x,), (torch.randn(6, 8),))


class DecodeHeads(nn.Module):
    def forward(self, x):  # x [B, 1, 64]: one token; moving its unit dim moves no data
        return x.view(x.shape[0], 1, 4, 16).transpose(1, 2) * 2, x.transpose(0, 2)


def test_permute_of_unit_dims_is_a_view():
    x = torch.randn(3, 1, 64)
    kg = apply(canonicalize, graph_of(DecodeHeads(), x, dynamic=({0: Dim("B", min=2)},)))
    sym = next(iter(kg.symbols))
    text = ir(kg)
    FileCheck().check(f"aten.view.default(%view, [{sym}, 4, 1, 16])").run(text)
    assert ops(kg).count("aten.permute.default") == 1  # x.transpose(0, 2) moves B past 64
    assert_same_as_eager(kg, DecodeHeads(), (x,), (torch.randn(5, 1, 64),))
