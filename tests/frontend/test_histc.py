"""torch.histc compiled by kiln (decompositions.histc), not run as PyTorch's op: the
expert counts of transformers 5's MoE layers."""

from __future__ import annotations

import warnings

import pytest
import torch

import kiln
from kiln.errors import KilnWarning
from kiln.frontend.decompositions import histc


@pytest.mark.parametrize("x,bins,lo,hi", [
    (torch.randint(0, 8, (37, 2)).float(), 8, 0, 7),  # a router's expert ids
    (torch.randn(300) * 3, 10, -2.0, 2.0),  # values outside the range: in no bin
    (torch.randn(300), 7, 0, 0),  # min == max: the data's range
    (torch.full((5,), 2.5), 4, 0, 0),  # all equal: widened by 1 each way
    (torch.tensor([0.0, 1.0, 2.0, float("nan"), 2.0]), 2, 0, 2),  # max in the last bin
])
def test_the_decomposition_counts_as_torch_does(x, bins, lo, hi):
    assert torch.equal(histc(x, bins, lo, hi), torch.histc(x, bins, lo, hi))


def test_random_ranges_and_bins_match_torch_exactly():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        x = torch.randn(300, generator=gen) * 3
        lo = float(torch.randn(1, generator=gen))
        hi = lo + float(torch.rand(1, generator=gen)) * 4 + 0.01
        bins = int(torch.randint(1, 50, (1,), generator=gen))
        assert torch.equal(histc(x, bins, lo, hi), torch.histc(x, bins, lo, hi))


class ExpertCounts(torch.nn.Module):
    """A MoE router's top-k and its tokens per expert, as transformers 5 counts them."""

    def __init__(self, experts: int = 6):
        super().__init__()
        self.gate = torch.nn.Linear(16, experts, bias=False)
        self.experts = experts

    def forward(self, x):
        picks = self.gate(x).topk(2, dim=-1).indices
        counts = torch.histc(picks.float(), bins=self.experts, min=0, max=self.experts - 1)
        return counts.cumsum(0)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_router_counting_with_histc_compiles_with_no_fallback(target):
    model = ExpertCounts().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnWarning)  # no op left to PyTorch
        exe = kiln.compile(model, (torch.randn(9, 16),), target=target)
    x = torch.randn(9, 16)
    with torch.no_grad():
        assert torch.equal(exe(x), model(x))
    assert not any("histc" in op.target for r in exe.plan.regions for op in r.ops)
