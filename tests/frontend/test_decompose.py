"""Ops kiln does not know but torch can decompose are decomposed, whatever torch's
export table keeps: torch 2.11 keeps aten._fused_rms_norm, what nn.RMSNorm becomes on a
GPU, and kiln must still compile every model using nn.RMSNorm there."""

from __future__ import annotations

import torch

import kiln


class FusedNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))

    def forward(self, x):
        return torch.ops.aten._fused_rms_norm(x, [8], self.w, 1e-5)[0] * 2


def test_an_op_the_export_table_keeps_is_decomposed(monkeypatch):
    full = torch.export.default_decompositions

    def like_torch_2_11():
        table = full()
        table.pop(torch.ops.aten._fused_rms_norm.default, None)
        return table

    monkeypatch.setattr(torch.export, "default_decompositions", like_torch_2_11)
    model, x = FusedNorm(), torch.randn(3, 8)
    for target in ("cpu", "interpret"):
        out = kiln.compile(model, (x,), target=target)(x)
        assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-5)


def test_kilns_own_decomposition_when_torch_has_none(monkeypatch):
    from torch._decomp import decomposition_table

    monkeypatch.delitem(decomposition_table, torch.ops.aten._fused_rms_norm.default)
    test_an_op_the_export_table_keeps_is_decomposed(monkeypatch)
    model = FusedNorm()
    x = torch.randn(2, 3, 8, dtype=torch.float16)
    out = kiln.compile(model.half(), (x,))(x)
    assert out.dtype == torch.float16
    ref = model.float()(x.float())
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-3
