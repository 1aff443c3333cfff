"""A value returned beside views of it (reshape, transpose, select, a chunk) keeps its
producer: only a reshape nothing else reads is folded into the region that makes it
(the fuzzer's VERIFY / VERIFY2 classes: a region read a value folded away, or a plan
output was never produced)."""

from __future__ import annotations

import pytest
import torch

import kiln


class ClampViews(torch.nn.Module):
    def forward(self, x):
        v = torch.clamp(x, min=x * 0.5)
        return v.reshape(-1), v.transpose(0, -1)


class ChunkAndReshape(torch.nn.Module):
    def forward(self, x):
        piece = x.chunk(4, 0)[3]
        return piece, piece.reshape(4, piece.shape[1], 2, 4)


class ValueAndItsViews(torch.nn.Module):
    def forward(self, x):
        m = x * 2
        return m, m.reshape(-1), m.select(1, 0), (x * 2).reshape(-1)  # CSE merges x * 2


class OnlyReshaped(torch.nn.Module):
    def forward(self, x):
        return (x + 1).reshape(-1)  # nothing else reads x + 1: folded, no copy region


@pytest.mark.parametrize("target", ["cpu", "interpret"])
@pytest.mark.parametrize("model,shape", [(ClampViews(), (33, 16)),
                                         (ChunkAndReshape(), (16, 6, 8)),
                                         (ValueAndItsViews(), (3, 4))],
                         ids=["clamp_views", "chunk_reshape", "value_and_views"])
def test_returned_views_of_one_value(model, shape, target):
    x = torch.randn(shape)
    got = kiln.compile(model, (x,), target=target)(x)
    for a, b in zip(got, model(x)):
        torch.testing.assert_close(a, b)


def test_a_reshape_nothing_else_reads_is_still_folded():
    x = torch.randn(3, 4)
    exe = kiln.compile(OnlyReshaped(), (x,))
    assert len(exe.plan.regions) == 1
    torch.testing.assert_close(exe(x), OnlyReshaped()(x))
