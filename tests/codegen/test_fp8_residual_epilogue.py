"""Residual adds after a block-scaled fp8 linear run in its kernel (dispatch/grouping.py,
templates/fp8_matmul/template.py `epilogue`): one region, the product rounded to its
dtype and then added as eager adds, in every form; other epilogues keep a region apart."""

import pytest
import torch

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.fp8_matmul import template as fp8_matmul
from kiln.ir.plan import RegionKind
from kiln.ops import fp8_linear, quantize_weight
from kiln.target import get_target
from tests.helpers import rel_err


class Residual(torch.nn.Module):
    def __init__(self, N, K, act=None, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        w, s = quantize_weight(torch.randn(N, K, generator=gen) * 0.05)
        self.register_buffer("w", w)
        self.register_buffer("s", s)
        self.act = act

    def forward(self, x, r):
        y = fp8_linear(x, self.w, self.s)
        if self.act == "silu":
            return r + torch.nn.functional.silu(y)
        if self.act == "chunk":
            g, u = y.chunk(2, -1)
            return r + g * u
        return r + y


def _fp8_regions(m, args, dynamic=None):
    plan = kiln.compile(m, args, compile_to="dispatch", target="interpret",
                        dynamic_shapes=dynamic)
    return plan, [r for r in plan.regions if r.kind == RegionKind.EXTERN]


@pytest.mark.parametrize("tokens,dtype", [(1, torch.bfloat16), (3, torch.float32),
                                          (70, torch.float32)])
def test_residual_add_joins_the_fp8_kernel_and_matches_eager(tokens, dtype):
    m = Residual(72, 300)
    x, r = torch.randn(tokens, 300).to(dtype), torch.randn(tokens, 72).to(dtype)
    plan, fp8 = _fp8_regions(m, (x, r))
    if tokens <= 64:  # decode's forms: the add is the kernel's epilogue
        assert len(plan.regions) == 1 and fp8[0].outputs != [fp8[0].anchor().name]
    exe = kiln.compile(m, (x, r), target="interpret")
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(exe(x, r).float(), m(x, r).float()) <= tol


@pytest.mark.parametrize("form", ["gemv", "swap", "dot"])
def test_every_form_adds_after_its_split_parts(form):
    m = Residual(72, 700, seed=2)
    x, r = torch.randn(2 if form != "gemv" else 1, 700), torch.randn(2 if form != "gemv" else 1, 72)
    plan, (region,) = _fp8_regions(m, (x, r))
    spec = fp8_matmul.generate(region, plan, get_target("interpret"), form=form)
    config = {"gemv": fp8_matmul.Config.make(4, 1, BM=1, BN=32, SPLIT_K=16, KB=2),
              "swap": fp8_matmul.Config.make(4, 1, BM=16, BN=64, SPLIT_K=16),
              "dot": fp8_matmul.Config.make(4, 1, BM=16, BN=32, SPLIT_K=16)}[form]
    kernel = TritonKernel(region, spec, config, interpret=True)
    values = {"b_w": m.w, "b_s": m.s, "x": x, "r": r}
    out = torch.full((x.shape[0], 72), float("nan"))
    kernel.run({v: values[v] for v in region.inputs}, {region.outputs[0]: out}, {})
    assert rel_err(out, m(x, r)) <= 1e-6


@pytest.mark.parametrize("act", ["silu", "chunk"])
def test_other_epilogues_keep_a_region_apart(act):
    m = Residual(72, 256, act=act)
    x, r = torch.randn(1, 256), torch.randn(1, 72 if act == "silu" else 36)
    plan, (region,) = _fp8_regions(m, (x, r))
    assert region.outputs == [region.anchor().name]
    assert any(r.kind == RegionKind.POINTWISE for r in plan.regions)
