"""Costly prologues read through a broadcast stay out of the reduction that reads them
(dispatch/recompute.py), and a reduction takes a pointwise row epilogue
(dispatch/grouping.py): the gathered experts' silu(g) * u is computed once, by the
region that sums g and u, not once per row of the down projection."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.dispatch import recompute
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


class Gathered(torch.nn.Module):
    """kiln.models.moe.Experts.gathered's products for given ids."""

    def __init__(self, experts=6, inter=32, dim=64):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.randn(experts, inter, dim) * 0.1)
        self.up = torch.nn.Parameter(torch.randn(experts, inter, dim) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(experts, dim, inter) * 0.1)

    def forward(self, x, ids, weights):
        xf = x.float()[:, None, None, :]
        g = (xf * self.gate[ids].float()).sum(-1)
        u = (xf * self.up[ids].float()).sum(-1)
        h = (F.silu(g) * u).to(x.dtype).float()
        y = (h[:, :, None, :] * self.down[ids].float()).sum(-1)
        return (y * weights[:, :, None]).sum(1).to(x.dtype)


def _inputs(dtype, dim=64, experts=6):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, dim, generator=gen).to(dtype)
    ids = torch.randperm(experts, generator=gen)[:2][None]
    return x, ids, torch.rand(1, 2, generator=gen)


def _with(region_ops, plan):
    return [r for r in plan.regions if region_ops <= {o.target for o in r.ops}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_experts_store_silu_times_up_once(monkeypatch, dtype):
    """Over the (lowered) threshold: g, u and silu(g) * u are one region (two sums of
    the same rows, x's cast fused), the down projection's sum reads h (in x's dtype:
    the cast to fp32 after it is recomputed) and computes no sigmoid; under the
    interpreter the result is eager's."""
    monkeypatch.setattr(recompute, "RECOMPUTE_MIN_ELEMENTS", 1024)
    model = Gathered().to(dtype)
    args = _inputs(dtype)
    exe = kiln.compile(model, args, target="interpret")
    plan = exe.plan
    (gu,) = _with({"aten.sigmoid.default"}, plan)
    assert gu.kind == RegionKind.REDUCTION
    assert sum(o.target == "aten.sum.dim_IntList" for o in gu.ops) == 2
    assert not [r for r in plan.regions if r.kind == RegionKind.POINTWISE], plan.regions
    assert plan.values[gu.outputs[0]].dtype == dtype  # h stored before its widening cast
    down = [r for r in plan.regions if gu.outputs[0] in r.inputs]
    assert len(down) == 1 and down[0].kind == RegionKind.REDUCTION
    with torch.no_grad():
        assert rel_err(exe(*args), model(*args)) <= TOL[dtype]


def test_small_broadcasts_and_cheap_prologues_stay_fused():
    """At the real threshold these tiny products recompute silu in the down sum (less
    than a launch); a cast is recomputed however often it is broadcast."""
    model = Gathered()
    plan = kiln.compile(model, _inputs(torch.float32), target="interpret",
                        compile_to="dispatch")
    (down,) = _with({"aten.sigmoid.default"}, plan)
    assert sum(o.target == "aten.sum.dim_IntList" for o in down.ops) == 1
    fp32 = recompute.RECOMPUTE_MIN_ELEMENTS

    class Cheap(Gathered):
        def forward(self, x, ids, weights):
            h = (x.float() * 3.0 + 1.0)[:, None, None, :]  # cheap: stays in the sums
            return (h * self.gate[ids].float()).sum(-1)

    try:
        recompute.RECOMPUTE_MIN_ELEMENTS = 1
        plan = kiln.compile(Cheap(), _inputs(torch.float32), target="interpret",
                            compile_to="dispatch")
    finally:
        recompute.RECOMPUTE_MIN_ELEMENTS = fp32
    assert [r.kind for r in plan.regions] == [RegionKind.REDUCTION]


class RowEpilogue(torch.nn.Module):
    def forward(self, x, y):
        s = x.sum(-1)
        return torch.sigmoid(s) * y + s, torch.sigmoid(x.amax(-1).t())


def test_a_reduction_takes_its_row_epilogue_but_not_through_a_view():
    """sigmoid(sum) * y + sum is computed by the sum's kernel; a sigmoid of the max read
    through a transpose (the same shape: rows are not the kernel's own) stays apart;
    every region a generated kernel, both outputs eager's under the interpreter."""
    from kiln.codegen.build.triton_kernel import TritonKernel

    x, y = torch.randn(5, 5, 40), torch.randn(5, 5)
    exe = kiln.compile(RowEpilogue(), (x, y), target="interpret")
    kinds = sorted(r.kind.value for r in exe.plan.regions)
    assert kinds == ["pointwise", "reduction", "reduction"], exe.plan.regions
    (summed,) = _with({"aten.sum.dim_IntList", "aten.sigmoid.default"}, exe.plan)
    assert summed.kind == RegionKind.REDUCTION
    assert all(isinstance(exe.program.kplan.kernels[r.name], TritonKernel)
               for r in exe.plan.regions)
    got, ref = exe(x, y), RowEpilogue()(x, y)
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, ref))
