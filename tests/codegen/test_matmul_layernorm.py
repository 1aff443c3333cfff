"""A LayerNorm folded into the decode GEMVs that read it (kiln.dispatch.fold_rmsnorm,
kiln.dispatch.layernorm_prologue): which plans fold, and the GEMV form's numerics under
Triton's interpreter against eager (fp32 1e-5, fp16 1e-2): affine or not, with or
without the norm's bias, grouped and paired readers, a residual stream far from zero
mean, forced split-K parts; compiled for sm_90 without a GPU."""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel, scratch_buffer
from kiln.codegen.templates.matmul import template as matmul
from kiln.codegen.torch_kernel import TorchKernel
from kiln.dispatch.layernorm_prologue import LAYER_NORM_MAX_K
from kiln.ir.plan import RegionKind
from kiln.target import get_target
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16])


def _layer_norm(dim, affine=True, bias=True):
    ln = torch.nn.LayerNorm(dim, elementwise_affine=affine, bias=bias)
    if affine:
        torch.nn.init.normal_(ln.weight, 1.0, 0.3)
        if bias:
            torch.nn.init.normal_(ln.bias, 0.0, 0.3)
    return ln


class LNLinear(torch.nn.Module):
    def __init__(self, dim=64, n=40, affine=True, bias=True, linear_bias=True):
        super().__init__()
        self.ln = _layer_norm(dim, affine, bias)
        self.lin = torch.nn.Linear(dim, n, bias=linear_bias)

    def forward(self, x):
        return self.lin(self.ln(x))


class GPT2Block(torch.nn.Module):
    """GPT-2's MLP half: the residual add before the norm, Conv1D's [in, out] weight
    through addmm, GELU, the second projection's residual."""

    def __init__(self, dim=64):
        super().__init__()
        self.ln = _layer_norm(dim)
        self.w_fc = torch.nn.Parameter(0.1 * torch.randn(dim, 4 * dim))
        self.b_fc = torch.nn.Parameter(0.1 * torch.randn(4 * dim))
        self.w_proj = torch.nn.Parameter(0.1 * torch.randn(4 * dim, dim))

    def forward(self, x, attn):
        h = x + attn
        y = torch.addmm(self.b_fc, self.ln(h).view(-1, h.shape[-1]), self.w_fc)
        return h + (torch.nn.functional.gelu(y) @ self.w_proj).view(h.shape)


class LNQKV(torch.nn.Module):
    """One norm read by three projections (StableLM's separate q, k, v)."""

    def __init__(self, dim=64, kv=32):
        super().__init__()
        self.ln = _layer_norm(dim)
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, kv)
        self.v = torch.nn.Linear(dim, kv)

    def forward(self, x):
        h = self.ln(x)
        return self.q(h), self.k(h), self.v(h)


class LNSwiGLU(torch.nn.Module):
    """Separate gate and up projections of one norm: paired products in one program."""

    def __init__(self, dim=64, hidden=48):
        super().__init__()
        self.ln = _layer_norm(dim)
        self.gate = torch.nn.Linear(dim, hidden, bias=False)
        self.up = torch.nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        h = self.ln(x)
        return torch.nn.functional.silu(self.gate(h)) * self.up(h)


class LNAlsoAdded(torch.nn.Module):
    def __init__(self, dim=64):
        super().__init__()
        self.ln = _layer_norm(dim)
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = self.ln(x)
        return self.lin(h) + h


def _compile(model, args, dtype, target="interpret"):
    model = model.to(dtype).eval()
    args = tuple(a.to(dtype) for a in args)
    return model, args, kiln.compile(model, args, target=target)


def _layer_norm_kernels(exe):
    kernels = [exe.program.kplan.kernels[r.name] for r in exe.plan.regions
               if r.kind == RegionKind.MATMUL]
    assert all(isinstance(k, TritonKernel) for k in kernels), [
        r.notes for r in exe.plan.regions]
    return [k for k in kernels if k.spec.meta["layer_norm"]]


def _check(model, args, exe, dtype):
    with torch.no_grad():
        got, ref = exe(*args), model(*args)
    for g, r in zip(got if isinstance(got, tuple) else (got,),
                    ref if isinstance(ref, tuple) else (ref,)):
        assert rel_err(g, r) <= TOL[dtype], rel_err(g, r)


@DTYPES
@pytest.mark.parametrize("form", [{}, {"bias": False}, {"affine": False},
                                  {"linear_bias": False}])
@pytest.mark.parametrize("dim", [64, 96])  # 96: a K tail past every BLOCK_K
def test_norm_then_linear(dtype, form, dim):
    """x far from zero mean (the centring term carries most of the product)."""
    model, args, exe = _compile(LNLinear(dim, **form), (3 * torch.randn(1, 1, dim) + 5,),
                                dtype)
    (k,) = _layer_norm_kernels(exe)
    assert k.spec.meta["form"] == "gemv" and len(exe.plan.regions) == 1
    assert k.spec.meta["row_norm"] and "layernorm" in k.spec.name
    _check(model, args, exe, dtype)


@DTYPES
def test_gpt2_mlp_with_the_residual_add_and_conv1d_weights(dtype):
    model, args, exe = _compile(GPT2Block(), (torch.randn(1, 1, 64), torch.randn(1, 1, 64)),
                                dtype)
    assert len(_layer_norm_kernels(exe)) == 1
    assert not [r for r in exe.plan.regions if r.kind == RegionKind.REDUCTION]
    _check(model, args, exe, dtype)


@DTYPES
def test_one_norm_into_three_grouped_projections(dtype):
    model, args, exe = _compile(LNQKV(), (torch.randn(1, 1, 64),), dtype)
    (k,) = _layer_norm_kernels(exe)
    assert len(k.spec.meta["siblings"]) == 3 and len(exe.plan.regions) == 1
    _check(model, args, exe, dtype)


@DTYPES
def test_norm_into_paired_gate_and_up(dtype):
    model, args, exe = _compile(LNSwiGLU(), (torch.randn(1, 1, 64),), dtype)
    (k,) = _layer_norm_kernels(exe)
    assert len(k.spec.meta["siblings"]) == 2
    _check(model, args, exe, dtype)


def test_dynamic_rows_each_take_their_own_statistics():
    """fp32 products of up to 8 rows stay GEMVs: each row's mean and rstd, rows past
    a dynamic M (read at M - 1) never stored."""
    t = torch.export.Dim("B", min=1, max=8)
    model = LNLinear(96).eval()
    exe = kiln.compile(model, (torch.randn(2, 1, 96),), target="interpret",
                       dynamic_shapes=({0: t},))
    assert len(_layer_norm_kernels(exe)) == 1
    with torch.no_grad():
        for b in (1, 5, 8):
            x = torch.randn(b, 1, 96) * torch.arange(1, b + 1).view(b, 1, 1) + 2
            assert rel_err(exe(x), model(x)) <= 1e-5


def test_norm_read_by_another_op_stays_apart_and_matches():
    model, args, exe = _compile(LNAlsoAdded(), (torch.randn(1, 1, 64),), torch.float32)
    assert not _layer_norm_kernels(exe)
    assert [r.kind for r in exe.plan.regions].count(RegionKind.REDUCTION) == 1
    _check(model, args, exe, torch.float32)


def test_prefill_rows_wide_rows_and_the_cpu_target_keep_the_norm():
    """Several fp16 rows take the tiled form; a row wider than LAYER_NORM_MAX_K is not
    loaded whole; the CPU target runs torch ops."""
    plans = [kiln.compile(LNLinear(dim).to(dtype), (torch.randn(1, rows, dim, dtype=dtype),),
                          target=target, compile_to="dispatch")
             for dim, rows, dtype, target in ((64, 3, torch.float16, "cuda:sm_90"),
                                              (2 * LAYER_NORM_MAX_K, 1, torch.float16,
                                               "cuda:sm_90"),
                                              (64, 1, torch.float32, "cpu"))]
    for plan in plans:
        assert [r.kind for r in plan.regions].count(RegionKind.REDUCTION) == 1


@pytest.mark.parametrize("dtype,rows,bias", [(torch.float32, 3, True),
                                             (torch.float16, 1, False)])
def test_split_k_parts_each_take_the_whole_rows_statistics(dtype, rows, bias):
    """Every part normalises with the statistics of the whole row (loaded whole before
    its K range), so the parts are plain partial products; padded rows included."""
    model = LNLinear(200, 40, bias=bias).to(dtype)
    plan = kiln.compile(model, (torch.randn(1, rows, 200, dtype=dtype),),
                        target="interpret", compile_to="dispatch")
    (region,) = plan.regions
    spec = matmul.generate(region, plan, get_target("interpret"))
    config = Config.make(2, 1, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4)
    kernel = TritonKernel(region, spec, config, interpret=True)
    assert spec.grid_for(kernel.sizes({}), config)[2] == 4
    inputs = {v: torch.randn(tuple(plan.values[v].shape), dtype=plan.values[v].dtype)
              for v in region.inputs}
    x = next(v for v in region.inputs if len(plan.values[v].shape) == 3)
    inputs[x] = 4 * inputs[x] + 3
    out = region.outputs[0]
    shape, odt = tuple(plan.values[out].shape), plan.values[out].dtype
    ref, got = {out: torch.empty(shape, dtype=odt)}, {out: torch.empty(shape, dtype=odt)}
    TorchKernel(region, "cpu").run(inputs, ref, {})
    kernel.run(inputs, got, {})
    assert rel_err(got[out], ref[out]) <= TOL[dtype], rel_err(got[out], ref[out])
    counts = scratch_buffer(spec.scratch[1], 1, 1, "cpu")
    assert not counts.any()  # zeroed for the next launch


def test_sm90_folded_gemv_compiles_without_spills():
    """Compiled for sm_90 (no GPU) at the widest folded row: the whole-row statistics
    spill nothing and run before the K loop, not in it."""
    sm90 = get_target("cuda:sm_90")
    plan = kiln.compile(LNLinear(LAYER_NORM_MAX_K, 256).half(),
                        (torch.randn(1, 1, LAYER_NORM_MAX_K).half(),),
                        target=sm90, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.MATMUL]
    spec = matmul.generate(region, plan, sm90)
    assert spec.meta["layer_norm"]
    head, loop = spec.source.split("for k0")[0], spec.source.split("for k0")[1]
    assert "rsqrt" in head and "rsqrt" not in loop.split("rm2 =")[0]
    for config in (spec.default, Config.make(4, 1, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1)):
        res = compile_binary(spec, config, sm90).resources
        assert res.spills in (0, None), (config, res.spills, res.registers)


def test_a_norm_over_a_dynamic_width_is_recognised_without_folding():
    """normalized_shape holds a symbolic size there (a Sym in the plan's ops): matched,
    compared as a dim, not folded (its width has no static bound for the whole-row load)."""
    d = torch.export.Dim("D", min=8, max=64)

    class Dynamic(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.layer_norm(x, (x.shape[-1],)), x.sum(-1)

    exe = kiln.compile(Dynamic(), (torch.randn(1, 1, 32),), target="interpret",
                       dynamic_shapes=({2: d},))
    x = torch.randn(1, 1, 48)
    with torch.no_grad():
        for g, r in zip(exe(x), Dynamic()(x)):
            assert rel_err(g, r) <= 1e-5
