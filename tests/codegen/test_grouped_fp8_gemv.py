"""Sibling fp8 decode GEMVs in one kernel (dispatch/group_fp8_siblings.py,
templates/fp8_matmul/grouped.py): V3's latent projections, a Llama's q / k / v and a
gated MLP at one token under Triton's interpreter against eager (the fp8 op's PyTorch
form: fp32 1e-5, bf16 1e-2), forced K splits with and without a K tail, a pair the
template declines split apart, the timed keep-or-split choice, and the kernels at
DeepSeek-V3's widths compiled for sm_90 without a GPU."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.resources import estimate, fitting_configs
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.fp8_matmul import grouped
from kiln.codegen.torch_kernel import TorchKernel
from kiln.dispatch.group_siblings import products
from kiln.ir.plan import RegionKind
from kiln.ir.verify import verify_plan
from kiln.models.fp8 import Fp8Linear
from kiln.target import get_target
from tests.dispatch.test_group_fp8_siblings import GatedMLP, LatentProjections, Qkv
from tests.helpers import assert_close_tree, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
SM90 = get_target("cuda:sm_90")


def _grouped_kernels(exe):
    out = []
    for r in exe.plan.regions:
        if len(products(r)) > 1:
            k = exe.program.kplan.kernels[r.name]
            assert isinstance(k, TritonKernel), r.notes
            out.append(k)
    return out


@pytest.mark.parametrize("block,dtype,bias", [
    (LatentProjections, torch.bfloat16, False), (Qkv, torch.float32, True),
    (GatedMLP, torch.float32, True), (GatedMLP, torch.bfloat16, False)])
def test_blocks_at_one_token_match_eager(block, dtype, bias):
    model = block(bias=bias).eval()
    model.norm.to(dtype)
    x = torch.randn(1, 1, 256, dtype=dtype)
    exe = kiln.compile(model, (x,), target="interpret")
    (k,) = _grouped_kernels(exe)
    assert len(k.spec.meta["siblings"]) == len(products(k.region))
    assert k.spec.meta["streams"] == (2 if block is GatedMLP else 1)
    with torch.no_grad():
        assert_close_tree(exe(x), model(x), TOL[dtype])


def _run_against_torch(model, dtype, config, tol=None):
    """The grouped region's kernel at `config` (twice: the split counters must be zero
    again) against the region's torch ops, within `tol` (TOL[dtype]); returns the split
    count."""
    model.norm.to(dtype)
    plan = kiln.compile(model, (torch.randn(1, 1, model.norm.weight.shape[0], dtype=dtype),),
                        target="interpret", compile_to="dispatch")
    (region,) = [r for r in plan.regions if len(products(r)) > 1]
    spec = grouped.generate(region, plan, get_target("interpret"))
    kernel = TritonKernel(region, spec, config, interpret=True)
    state = dict(model.named_parameters()) | dict(model.named_buffers())
    named = {"p_" + k.replace(".", "_"): v for k, v in state.items()}
    inputs = {v: named[v] if v in named else
              torch.randn(tuple(plan.values[v].shape), dtype=plan.values[v].dtype)
              for v in region.inputs}
    outs = {o: (tuple(plan.values[o].shape), plan.values[o].dtype) for o in region.outputs}
    ref = {o: torch.empty(s, dtype=d) for o, (s, d) in outs.items()}
    TorchKernel(region, "cpu").run(inputs, ref, {})
    for _ in range(2):
        got = {o: torch.full(s, float("nan"), dtype=d) for o, (s, d) in outs.items()}
        kernel.run(inputs, got, {})
        for o in region.outputs:
            assert rel_err(got[o].float(), ref[o].float()) <= (tol or TOL[dtype]), o
    return spec.grid_for(kernel.sizes({}), config)[2]


@pytest.mark.parametrize("block,dim,dtype", [(LatentProjections, 512, torch.float32),
                                             (GatedMLP, 300, torch.bfloat16)])
def test_forced_k_splits(block, dim, dtype):
    """Every program's parts (both products' for a pair) go to its global column
    block's slot; K = 512 takes the unmasked steps, 300 the K tail."""
    config = Config.make(4, 1, BM=1, BN=32, SPLIT_K=16, KB=1)
    assert _run_against_torch(block(dim=dim, bias=True), dtype, config) == -(-dim // 128)


@pytest.mark.parametrize("block,dtype", [(LatentProjections, torch.float32),
                                         (GatedMLP, torch.bfloat16)])
def test_packed_product_in_groups_and_pairs(block, dtype, monkeypatch):
    """The GPUs' packed fp16 product (emulated on the interpreter): each sibling's words
    from its own pointer, a pair's two streams against one x's pairs."""
    from kiln.codegen.templates.fp8_matmul import packed_product

    monkeypatch.setattr(packed_product, "packs", lambda target, k_tail: not k_tail)
    config = Config.make(4, 1, BM=1, BN=32, SPLIT_K=16, KB=2)
    # fp16 sums of four exact products: ~1e-4 off the op's fp32 ones
    assert _run_against_torch(block(dim=512, bias=True), dtype, config, 2e-3) == 2


class ShiftedPair(GatedMLP):
    """The pointwise ops read the products at other columns than their own."""

    def forward(self, x):
        h = self.norm(x)
        return F.silu(self.gate(h))[..., :80] * self.up(h)[..., 80:]


def test_a_pair_the_template_declines_runs_apart():
    model = ShiftedPair().eval()
    x = torch.randn(1, 1, 256)
    exe = kiln.compile(model, (x,), target="interpret")
    assert not _grouped_kernels(exe)
    notes = [n for r in exe.plan.regions for n in r.notes]
    assert any("siblings apart: the grouped GEMV declines" in n for n in notes), notes
    assert all(isinstance(exe.program.kplan.kernels[r.name], TritonKernel)
               for r in exe.plan.regions)
    with torch.no_grad():
        assert rel_err(exe(x), model(x)) <= 1e-5


@pytest.mark.parametrize("apart_ms,kept", [(5.0, True), (1.0, False)])
def test_timed_pair_kept_only_when_faster_than_apart(monkeypatch, apart_ms, kept):
    """The pair (3 ms, planted) against its products and the pointwise ops apart."""
    from kiln.codegen import select_kernels as sk
    from kiln.codegen.kernel_plan import KernelPlan

    plan = kiln.compile(GatedMLP(), (torch.randn(1, 1, 256),), target="interpret",
                        compile_to="dispatch")
    (region,) = [r for r in plan.regions if len(products(r)) > 1]
    before = [r.name for r in plan.regions]

    class Tuner:
        times = {region.name: 3.0}

    def planted(r, spec, target, ctx, plan, tuner):
        tuner.times[r.name] = apart_ms / 3
        return TorchKernel(r, "cpu")

    monkeypatch.setattr(sk, "choose", planted)
    ctx = type("Ctx", (), {"target": get_target("interpret"), "options": {}})()
    kp = KernelPlan(plan, ctx.target)
    kp.kernels[region.name] = "paired"
    sk._siblings_apart_if_faster(plan, region, ctx, kp, Tuner())
    assert verify_plan(plan) == []
    if kept:
        assert [r.name for r in plan.regions] == before and kp.kernels == {region.name:
                                                                          "paired"}
        assert region.kind == RegionKind.EXTERN and "siblings kept grouped" in region.notes[-1]
    else:
        assert len(plan.regions) == len(before) + 2 and region.kind == RegionKind.POINTWISE
        assert len(kp.kernels) == 3


class V3Siblings(torch.nn.Module):
    """DeepSeek-V3's widths on the meta device: a bf16 norm, fp8 siblings of its output
    (paired: SiLU(gate) * up)."""

    def __init__(self, widths, pair, dim=7168, device="meta"):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=torch.bfloat16, device=device))
        self.pair = pair
        self.projs = torch.nn.ModuleList(Fp8Linear(dim, n, False, device=device)
                                         for n in widths)

    def forward(self, x):
        v = x.float()
        h = self.weight * (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        ys = [p(h) for p in self.projs]
        return F.silu(ys[0]) * ys[1] if self.pair else tuple(ys)


@pytest.mark.parametrize("widths,pair", [((1536, 576), False), ((18432, 18432), True),
                                         ((2048, 2048), True)])
def test_v3_widths_compile_for_sm90(widths, pair):
    """q_a / kv_a, the dense MLP's and the shared expert's gate / up: the default
    compiles within the model's shared memory, without spilling, under 128 registers
    (four programs an SM at least), streaming 16-byte weight vectors; every
    candidate fits sm_90's shared memory."""
    model = V3Siblings(widths, pair)
    x = torch.empty(1, 1, 7168, dtype=torch.bfloat16, device="meta")
    plan = kiln.compile(model, (x,), target=SM90, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    assert len(products(region)) == 2
    spec = grouped.generate(region, plan, SM90)
    assert spec.meta["form"] == "gemv" and spec.meta["streams"] == (2 if pair else 1)
    assert set(fitting_configs(spec, SM90).configs) == set(spec.configs)
    binary = compile_binary(spec, spec.default, SM90)
    real = binary.resources
    assert real.shared <= estimate(spec, spec.default, SM90).shared, real
    assert real.spills == 0 and real.registers <= 128, real
    assert "ld.global.v4.b32" in binary.asm["ptx"]


@pytest.mark.gpu
@pytest.mark.parametrize("widths,pair", [((1536, 576), False), ((2048, 2048), True)])
def test_v3_widths_on_cuda_match_eager(widths, pair):
    """q_a / kv_a and the shared expert's gate / up at V3's widths, bf16, one token, on
    a GPU (run by the lead): grouped (untimed: the group stays), within bf16 rounding
    of the same fp8 module run eagerly."""
    from kiln.ops import quantize_weight

    model = V3Siblings(widths, pair, device="cuda")
    for proj in model.projs:
        w, s = quantize_weight(torch.randn(proj.out_features, 7168, device="cuda") * 0.02)
        proj.weight.data, proj.weight_scale_inv.data = w, s
    x = torch.randn(1, 1, 7168, device="cuda", dtype=torch.bfloat16)
    exe = kiln.compile(model, (x,), target="cuda", options={"tune": "none"})
    (k,) = _grouped_kernels(exe)
    assert k.spec.meta["streams"] == (2 if pair else 1)
    with torch.no_grad():
        assert_close_tree(exe(x), model(x), 1e-2)
