import torch
import torch.nn as nn
from torch.testing import FileCheck

from kiln.graph.fold_constants import STATE_PREFIX, fold_constants
from tests.graph.util import Dim, apply, assert_same_as_eager, graph_of, ir, ops


class CastWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        w = (self.w * self.scale).t().half()  # compute, a view, a narrowing cast
        return (x.half() @ w).float()


def test_cast_of_scaled_weight_becomes_one_constant():
    x = torch.randn(3, 8)
    m = CastWeight()
    kg = apply(fold_constants, graph_of(m, x, dynamic=({0: Dim("T", min=1)},)))
    folded = [i for i in kg.inputs if i.kind == "constant"]
    assert len(folded) == 1
    value = kg.state[folded[0].target]
    assert folded[0].target.startswith(STATE_PREFIX)
    assert value.dtype == torch.float16 and value.shape == (8, 6)
    torch.testing.assert_close(value, (m.w * m.scale).t().half().contiguous())
    FileCheck().check(f"%{folded[0].name}: f16[8, 6] = constant").check("aten.mm.default").run(
        ir(kg))
    # What the runtime still does with x is untouched; the weight-only ops are gone, and
    # so are the weights only they read.
    assert "aten.mul.Tensor" not in ops(kg)
    assert [i.kind for i in kg.inputs] == ["constant", "user"]
    assert_same_as_eager(kg, m, (x,), (torch.randn(9, 8),), tol=1e-3)


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))

    def forward(self, x):
        return x @ self.w.t()[:, :3]


def test_views_alone_are_not_folded():
    m = Views()
    kg = apply(fold_constants, graph_of(m, torch.randn(2, 6)))
    assert not [i for i in kg.inputs if i.kind == "constant"]
    FileCheck().check("aten.permute.default(%p_w").run(ir(kg))


class Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(16))

    def forward(self, x):
        big = (self.b * 2).expand(64, 16) + torch.ones(64, 16)  # 64x larger than b
        return x + big


def test_growing_results_are_not_folded():
    m = Broadcast()
    kg = apply(fold_constants, graph_of(m, torch.randn(64, 16)))
    folded = [i for i in kg.inputs if i.kind == "constant"]
    # b * 2 is as large as b: folded; the broadcast sum is not.
    assert [tuple(kg.state[i.target].shape) for i in folded] == [(16,)]
    assert "aten.add.Tensor" in ops(kg)
    assert_same_as_eager(kg, m, (torch.randn(64, 16),))


class Cache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4))
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        self.cache.add_(1.0)
        return x * (self.cache * 2) + x * self.w.exp()


def test_never_folds_mutable_buffers_or_user_inputs():
    kg = apply(fold_constants, graph_of(Cache(), torch.randn(4)))
    folded = [i for i in kg.inputs if i.kind == "constant"]
    assert len(folded) == 1  # only exp(w)
    text = ir(kg)
    FileCheck().check("aten.mul.Tensor(%add, 2)").run(text)  # the cache's new value * 2
    assert "aten.exp.default" not in ops(kg)


class OnlyCreate(nn.Module):
    def forward(self, x):
        return x + torch.arange(8) * 2


def test_create_only_subgraphs_stay_recomputed():
    kg = apply(fold_constants, graph_of(OnlyCreate(), torch.randn(8)))
    assert not [i for i in kg.inputs if i.kind == "constant"]
    assert "aten.arange.start_step" in ops(kg) or "aten.arange.default" in ops(kg)
