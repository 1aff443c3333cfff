"""An example tensor's layout does not constrain the compiled module (api._dense_examples):
torch.export guards on strides, kiln's modules make every input dense at call time."""

from __future__ import annotations

import torch

import kiln


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 8)

    def forward(self, ids):
        return self.e(ids).sum(-1)


def test_a_sliced_example_compiles_for_every_length_of_its_dim():
    model = Embed()
    example = torch.randint(0, 50, (2, 12))[:, :5]  # strides (12, 1): not contiguous
    exe = kiln.compile(model, (example,), dynamic_shapes={"ids": {1: kiln.Dim("T", max=12)}})
    for n in (1, 5, 12):
        ids = torch.randint(0, 50, (2, 20))[:, :n]  # calls may be sliced too
        assert torch.equal(exe(ids), model(ids))
    assert not example.is_contiguous()  # the caller's tensor is left as it was


def test_a_channels_last_example_matches_eager():
    conv = torch.nn.Conv2d(3, 4, 3).eval()
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    exe = kiln.compile(conv, (x,))
    assert torch.allclose(exe(x), conv(x), atol=1e-5)
