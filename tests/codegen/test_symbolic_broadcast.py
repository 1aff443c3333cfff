"""A dim torch's slicing leaves symbolic but always 1 (MPT's ALiBi bias sliced to the
last T positions of a [1, heads, 1, max] buffer: 1 - Max(0, 1 - T) rows) broadcasts as
1: it once was read at the query index, and the model's generated kernels went wrong
(random rows of the bias) at every dynamic length."""

import pytest
import torch
from torch.utils._sympy.functions import Max

import kiln
from kiln.codegen.expr.indexing import Lin, Var, broadcast_index
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.ir.symbolic import symbol


class AlibiScores(torch.nn.Module):
    def __init__(self, heads=4, max_len=64):
        super().__init__()
        self.register_buffer("alibi", torch.randn(1, heads, 1, max_len))

    def forward(self, scores):  # [B, heads, T, T]
        t = scores.shape[-1]
        return torch.softmax(scores * 0.25 + self.alibi[:, :, -t:, -t:], -1)


@pytest.mark.parametrize("target", ["interpret", "cpu"])
def test_a_symbolic_unit_dim_broadcasts(target):
    model = AlibiScores()
    T = kiln.Dim("t", min=2, max=32)
    exe = kiln.compile(model, (torch.randn(2, 4, 7, 7),), dynamic_shapes=({2: T, 3: T},),
                       target=target)
    for t in (5, 13, 32):
        x = torch.randn(2, 4, t, t)
        want = model(x)
        assert ((exe(x) - want).norm() / want.norm()).item() < 1e-5, t


def test_an_unprovable_piecewise_broadcast_declines():
    s, u = symbol("s0"), symbol("s1")
    index = (Lin.of(Var("x", s)),)
    assert broadcast_index(index, (s,), (1,)) == (Lin(),)
    assert broadcast_index(index, (s,), (s,)) == index
    # two symbols export guarded equal (another input's dim): read at the output's index
    assert broadcast_index(index, (s,), (u,)) == index
    with pytest.raises(CodegenUnsupported, match="neither 1 nor"):
        broadcast_index(index, (s,), (1 - Max(0, 1 - s),))  # torch's Max: kept


class TailWrite(torch.nn.Module):
    """The last t positions of a fixed buffer overwritten (`buf[:, -t:] = x`): a
    slice_scatter from a symbolic, negative start."""

    def __init__(self, width=16):
        super().__init__()
        self.register_buffer("base", torch.randn(3, width))

    def forward(self, x):  # [3, t]
        out = self.base.clone()
        out[:, -x.shape[1]:] = x * 2
        return out + 1


@pytest.mark.parametrize("target", ["interpret", "cpu"])
def test_a_slice_from_a_symbolic_negative_start(target):
    model = TailWrite()
    T = kiln.Dim("t", min=2, max=15)
    exe = kiln.compile(model, (torch.randn(3, 5),), dynamic_shapes=({1: T},), target=target)
    for t in (3, 9, 15):
        x = torch.randn(3, t)
        assert torch.allclose(exe(x), model(x), atol=1e-6), t
