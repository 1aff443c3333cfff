"""as_strided that reads its input in order compiles as a view (no fallback, so
fallback="error" accepts it); any other as_strided still falls back, and both match
eager on the generated kernels."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.errors import KilnWarning, UnsupportedOpError


class PooledTokens(nn.Module):
    """Swin's head (AdaptiveAvgPool1d over tokens: its decomposition strides the
    [B, C, 1, 1] mean as itself) and an as_strided by hand that flattens in order."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x):
        pooled = torch.flatten(self.pool(x.transpose(1, 2)), 1)
        flat = (x * 2).as_strided((x.shape[0], x.shape[1] * 8), (x.shape[1] * 8, 1))
        return pooled, flat


class Windows(nn.Module):
    """Overlapping windows (each row starts 2 past the last) of a transposed input:
    not a view, kept as PyTorch's op."""

    def forward(self, x):
        return (x + 1).t().as_strided((3, 4), (2, 1)) * 3


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_in_order_as_strided_compiles_without_a_fallback(target):
    model = PooledTokens()
    batch = kiln.Dim("B", min=2, max=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)  # no fallback warned
        exe = kiln.compile(model, (torch.randn(2, 5, 8),), dynamic_shapes=({0: batch},),
                           target=target, fallback="error")
    assert "aten.as_strided" not in exe.describe()
    x = torch.randn(3, 5, 8)
    for got, want in zip(exe(x), model(x)):
        assert _rel(got, want) < 1e-5


def test_other_as_strided_falls_back_and_matches_eager():
    model = Windows()
    with pytest.raises(UnsupportedOpError, match="as_strided"):
        kiln.compile(model, (torch.randn(4, 3),), fallback="error")
    with pytest.warns(KilnWarning, match="as_strided"):
        exe = kiln.compile(model, (torch.randn(4, 3),), target="interpret")
    x = torch.randn(4, 3)
    assert _rel(exe(x), model(x)) < 1e-6
