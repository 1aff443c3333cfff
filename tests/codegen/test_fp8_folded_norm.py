"""An RMSNorm folded into the one-token fp8 GEMV (dispatch/fold_rmsnorm.py,
templates/fp8_matmul/folded_norm.py): no norm kernel before the fp8 linear that reads it,
the same result as the norm then the op, with K split or not; more tokens, or several fp8
readers, keep the norm apart."""

import pytest
import torch

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.fp8_matmul import template as fp8_matmul
from kiln.ir.plan import RegionKind
from kiln.ops import fp8_linear, quantize_weight
from kiln.target import get_target
from tests.helpers import rel_err


class NormThenFp8(torch.nn.Module):
    """x -> RMSNorm (Llama's: fp32 math, cast back, times the weight) -> fp8 linear(s)."""

    def __init__(self, N, K, readers=1, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.norm_w = torch.nn.Parameter(1 + 0.1 * torch.randn(K, generator=gen))
        for i in range(readers):
            w, s = quantize_weight(torch.randn(N, K, generator=gen) * 0.05)
            self.register_buffer(f"w{i}", w)
            self.register_buffer(f"s{i}", s)
        self.readers = readers

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = self.norm_w * h.to(x.dtype)
        return [fp8_linear(y, getattr(self, f"w{i}"), getattr(self, f"s{i}"))
                for i in range(self.readers)]


def _plan(m, x, dynamic=None):
    return kiln.compile(m, (x,), compile_to="dispatch", target="interpret",
                        dynamic_shapes=dynamic)


def _eager(m, x):
    return [t.float() for t in m(x)]


@pytest.mark.parametrize("K,dtype", [(512, torch.bfloat16), (300, torch.float32)])
def test_one_token_folds_and_matches_the_norm_then_the_op(K, dtype):
    m = NormThenFp8(72, K)
    x = (torch.randn(1, 1, K) * 3).to(dtype)
    plan = _plan(m, x)
    assert not [r for r in plan.regions if r.kind == RegionKind.REDUCTION]
    exe = kiln.compile(m, (x,), target="interpret")
    (kernel,) = [k for k in exe.program.kplan.kernels.values() if isinstance(k, TritonKernel)]
    assert "rmsnorm" in kernel.spec.name and kernel.spec.meta["row_norm"]
    assert rel_err(exe(x)[0].float(), _eager(m, x)[0]) <= 2e-2


def test_the_packed_product_folds_the_norm_too(monkeypatch):
    """The GPUs' packed fp16 product (emulated on the interpreter) with the norm folded:
    the sums of squares beside it, x * w quantised and paired."""
    from kiln.codegen.templates.fp8_matmul import packed_product

    monkeypatch.setattr(packed_product, "packs", lambda target, k_tail: not k_tail)
    m = NormThenFp8(72, 1024)
    x = (torch.randn(1, 1, 1024) * 3).to(torch.bfloat16)
    exe = kiln.compile(m, (x,), target="interpret")
    (kernel,) = [k for k in exe.program.kplan.kernels.values() if isinstance(k, TritonKernel)]
    assert kernel.spec.meta["row_norm"] and "p_lo" in kernel.spec.source
    assert rel_err(exe(x)[0].float(), _eager(m, x)[0]) <= 2e-2


@pytest.mark.parametrize("K", [700, 512])
def test_split_k_parts_carry_the_sums_of_squares(K):
    """K over several programs (a tail block in one): each part carries its rows' x^2,
    summed with the products, and the row scale applies once after the combine."""
    m = NormThenFp8(72, K, seed=3)
    x = torch.randn(1, K) * 2
    plan = _plan(m, x)
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    spec = fp8_matmul.generate(region, plan, get_target("interpret"))
    config = fp8_matmul.Config.make(4, 1, BM=1, BN=32, SPLIT_K=16, KB=2)
    kernel = TritonKernel(region, spec, config, interpret=True)
    assert kernel.spec.grid_for(kernel.sizes({}), config)[2] == -(-K // 256)
    state = dict(m.named_parameters()) | dict(m.named_buffers())
    # the exported names of the module's tensors (p_norm_w, b_w0, ...), else the input
    inputs = {v: state[v[2:]] if v[:2] in ("p_", "b_") else x for v in region.inputs}
    out = torch.full((1, 72), float("nan"))
    kernel.run(inputs, {region.outputs[0]: out}, {})
    assert rel_err(out, _eager(m, x)[0]) <= 1e-2


def test_more_tokens_or_several_fp8_readers_keep_the_norm_apart():
    m = NormThenFp8(72, 256)
    x = torch.randn(3, 256)
    assert [r for r in _plan(m, x).regions if r.kind == RegionKind.REDUCTION]
    dyn = ({0: torch.export.Dim("t", min=1, max=4)},)
    assert [r for r in _plan(m, torch.randn(2, 256), dyn).regions
            if r.kind == RegionKind.REDUCTION]
    siblings = NormThenFp8(72, 256, readers=2)
    assert [r for r in _plan(siblings, torch.randn(1, 256)).regions
            if r.kind == RegionKind.REDUCTION]


def test_cpu_target_keeps_the_norm():
    m = NormThenFp8(72, 256)
    x = torch.randn(1, 256)
    exe = kiln.compile(m, (x,), target="cpu")
    assert rel_err(exe(x)[0], _eager(m, x)[0]) <= 1e-6


def test_llama_width_folded_gemv_compiles_for_sm90_without_spills():
    from kiln.codegen.build.compiler import compile_binary, disassemble

    m = NormThenFp8(6144, 4096)
    plan = kiln.compile(m, (torch.randn(1, 1, 4096, dtype=torch.bfloat16),),
                        compile_to="dispatch", target="cuda:sm_90")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    sm90 = get_target("cuda:sm_90")
    spec = fp8_matmul.generate(region, plan, sm90)
    assert spec.meta["row_norm"] and spec.meta["form"] == "gemv"
    b = compile_binary(spec, spec.default, sm90)
    assert b.resources.spills == 0 and b.resources.shared <= sm90.shared_mem_per_block
    sass = disassemble(b)
    assert sass is None or "LDG.E.128" in sass  # the weight still streams in 16-byte loads


def test_folded_is_as_close_to_the_unquantised_product_as_eager_is():
    """Eager rounds y to bf16 before quantising, the fold quantises x * w in fp32: their
    e4m3 roundings differ (~1e-2 apart), but neither is the closer to the exact norm
    and product."""
    from kiln.ops.fp8_linear import dequantize_weight

    worse = 0
    for seed in range(6):
        m = NormThenFp8(96, 512, seed=seed)
        x = (torch.randn(1, 512, generator=torch.Generator().manual_seed(seed)) * 3
             ).to(torch.bfloat16)
        h = x.double()
        y = m.norm_w.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        exact = y @ dequantize_weight(m.w0, m.s0).double().T
        got = kiln.compile(m, (x,), target="interpret")(x)[0].double()
        worse += rel_err(got, exact) > rel_err(m(x)[0].double(), exact) * 1.25
    assert worse <= 1
