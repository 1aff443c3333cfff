"""Ops kiln does not know but torch can decompose are decomposed, whatever torch's
export table keeps: torch 2.11's keeps aten._fused_rms_norm, what nn.RMSNorm becomes on a
GPU, and has no Python decomposition of it; kiln must still compile every model using
nn.RMSNorm there."""

from __future__ import annotations

import pytest
import torch
from torch._decomp import decomposition_table

import kiln
from kiln.frontend.export import decompose

FUSED = torch.ops.aten._fused_rms_norm.default


class FusedNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))
        self.norm = torch.nn.RMSNorm(8)

    def forward(self, x):
        return self.norm(torch.ops.aten._fused_rms_norm(x, [8], self.w, 1e-5)[0] * 2)


def _without_fused_rms_norm(monkeypatch, torch_has_one: bool) -> None:
    full = torch.export.default_decompositions

    def like_torch_2_11():
        table = full()
        if FUSED in table:
            table.pop(FUSED)
        return table

    monkeypatch.setattr(torch.export, "default_decompositions", like_torch_2_11)
    if not torch_has_one:
        monkeypatch.delitem(decomposition_table, FUSED)


@pytest.mark.parametrize("torch_has_one", [True, False])
def test_fused_rms_norm_compiles_when_exports_table_keeps_it(monkeypatch, torch_has_one):
    _without_fused_rms_norm(monkeypatch, torch_has_one)
    model, x = FusedNorm(), torch.randn(3, 8)
    for target in ("cpu", "interpret"):
        out = kiln.compile(model, (x,), target=target)(x)
        assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-5)


def test_kilns_own_decomposition_keeps_half_precision(monkeypatch):
    _without_fused_rms_norm(monkeypatch, torch_has_one=False)
    model = FusedNorm().half()
    x = torch.randn(2, 3, 8, dtype=torch.float16)
    out = kiln.compile(model, (x,))(x)
    assert out.dtype == torch.float16
    ref = model.float()(x.float())
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-3


def test_rms_norm_is_decomposed_by_kiln_on_every_device(monkeypatch):
    """On a GPU torch 2.11 turns rms_norm into _fused_rms_norm while decomposing; kiln
    decomposes rms_norm itself so no fused op ever reaches the graph."""
    _without_fused_rms_norm(monkeypatch, torch_has_one=False)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RMSNorm(8, eps=1e-6))
    x = torch.randn(4, 8)
    ep = decompose(torch.export.export(model, (x,)))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("rms_norm" in op for op in ops), ops
    for target in ("cpu", "interpret"):
        out = kiln.compile(model, (x,), target=target)(x)
        assert torch.allclose(out, model(x), rtol=1e-5, atol=1e-5)


class StridedLerp(torch.nn.Module):
    """torch.lerp of a transposed bf16 tensor: its decomposition leaves
    prims.copy_strided (fuzzer seed 501464 was refused as "not an ATen op")."""

    def forward(self, a, b):
        return torch.lerp(a.transpose(0, 1), b, 0.3).mean(0)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_strided_copy_from_a_decomposition_compiles(target):
    a, b = torch.randn(7, 16, dtype=torch.bfloat16), torch.randn(16, 7, dtype=torch.bfloat16)
    exe = kiln.compile(StridedLerp(), (a, b), target=target)
    ref = StridedLerp()(a, b).float()
    assert ((exe(a, b).float() - ref).norm() / ref.norm()).item() <= 1e-2
