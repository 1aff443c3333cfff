"""What multimodal models do at their image tokens compiles: a check on a tensor's value
(Llava's image-token count against its image features, through transformers'
torch_compilable_check; the runtime assert and the item() and comparisons only it reads
go, as kiln drops export's asserts), and masked_scatter (kiln's decomposition)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kiln


class PlaceImages(nn.Module):
    """Image features written at the placeholder tokens of a text embedding, after
    checking (as Llava does) that there are as many placeholders as feature rows."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)

    def forward(self, ids, feats):
        x = self.embed(ids)
        mask = ids == 7
        torch._check_tensor_all(mask.sum() * x.shape[-1] == feats.numel())
        rows = torch.cumsum(mask.flatten().long(), 0).clamp(min=1) - 1
        placed = feats.reshape(-1, x.shape[-1])[rows].reshape(x.shape)
        return torch.where(mask[..., None], placed, x) * 2


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 7, (2, 6), generator=g)
    ids[:, 1:3] = 7
    return ids, torch.randn(4, 8, generator=g)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_a_check_on_a_value_compiles_and_matches_eager(target):
    model = PlaceImages()
    exe = kiln.compile(model, _inputs(0), target=target, fallback="error")
    text = exe.describe()
    assert "_local_scalar_dense" not in text and "assert" not in text
    ids, feats = _inputs(1)
    want = model(ids, feats)
    assert ((exe(ids, feats) - want).norm() / want.norm()).item() < 1e-6


class ScatterImages(nn.Module):
    """Llava's placement: image features written at the image tokens by masked_scatter
    (the mask broadcast over the hidden dim)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)

    def forward(self, ids, feats):
        x = self.embed(ids)
        mask = (ids == 7).unsqueeze(-1)
        return x.masked_scatter(mask, feats) + 1


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_masked_scatter_compiles_and_matches_eager(target):
    model = ScatterImages()
    exe = kiln.compile(model, _inputs(0), target=target, fallback="error")
    assert "masked_scatter" not in exe.describe()
    ids, feats = _inputs(1)
    ids[1] = ids[1].roll(2)  # the second row's image tokens elsewhere
    want = model(ids, feats)
    assert ((exe(ids, feats) - want).norm() / want.norm()).item() < 1e-6
