"""The matmul template under Triton's interpreter: mm / addmm / bmm with fused epilogues,
the GEMV form, weights read in place, dynamic rows with tails; compared with eager."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.matmul import template as matmul
from kiln.ir.plan import RegionKind
from kiln.target import get_target
from tests.helpers import rel_err

T = torch.export.Dim("T", min=1, max=64)


def _kernels(exe, kind=RegionKind.MATMUL):
    kp = exe.program.kplan
    return [kp.kernels[r.name] for r in exe.plan.regions if r.kind == kind]


class LinearEpilogue(torch.nn.Module):
    """addmm + relu + per-column scale + residual, and a cast to fp16 after a bias-free one."""

    def __init__(self, k=40, n=24):
        super().__init__()
        self.lin = torch.nn.Linear(k, n)
        self.lin2 = torch.nn.Linear(k, n, bias=False)
        self.scale = torch.nn.Parameter(torch.randn(n))

    def forward(self, x, r):
        a = torch.relu(self.lin(x)) * self.scale + r
        b = F.silu(self.lin2(x)).to(torch.float16)
        return a, b


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2),
                                       (torch.bfloat16, 1e-2)])
def test_linear_with_fused_epilogue_matches_eager(dtype, tol):
    model = LinearEpilogue().to(dtype)
    x, r = torch.randn(2, 7, 40, dtype=dtype), torch.randn(2, 7, 24, dtype=dtype)
    exe = kiln.compile(model, (x, r), dynamic_shapes=({1: T}, {1: T}), target="interpret")
    kernels = _kernels(exe)
    assert len(kernels) == 2 and all(k.kind == "triton" for k in kernels)
    assert len(exe.plan.regions) == 2  # relu, scale, residual and cast fused: no more regions
    for t in (7, 29, 1):  # tails of every tile size; one row
        x, r = torch.randn(2, t, 40, dtype=dtype), torch.randn(2, t, 24, dtype=dtype)
        with torch.no_grad():
            for o, e in zip(exe(x, r), model(x, r)):
                assert o.dtype == e.dtype and rel_err(o, e) <= tol, (t, rel_err(o, e))


def test_weight_is_read_in_place_through_its_permute():
    """permute(W) of an [N, K] weight is B with swapped strides: the kernel reads W."""
    model = LinearEpilogue()
    x, r = torch.randn(2, 7, 40), torch.randn(2, 7, 24)
    exe = kiln.compile(model, (x, r), target="interpret")
    region = next(rg for rg in exe.plan.regions if "p_lin2_weight" in rg.inputs)
    spec = exe.program.kplan.kernels[region.name].spec
    weight_arg = next(a for a in spec.args if a.value == "p_lin2_weight")
    assert weight_arg.kind == "tensor"
    assert any(r.role.value == "weight" for r in [exe.plan.values["p_lin2_weight"]])
    # B[k, n] = W[n, k]: the load walks W's rows by K = 40, k contiguous
    (load,) = [ln for ln in spec.source.splitlines() if f"tl.load({weight_arg.name} " in ln]
    assert "40 * rb2" in load and "kb2" in load


class SwiGLU(torch.nn.Module):
    def __init__(self, d=32, h=48):
        super().__init__()
        self.gate = torch.nn.Linear(d, h, bias=False)
        self.up = torch.nn.Linear(d, h, bias=False)
        self.down = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def test_swiglu_silu_mul_fuses_into_a_matmul_epilogue():
    model = SwiGLU()
    x = torch.randn(1, 9, 32)
    exe = kiln.compile(model, (x,), dynamic_shapes=({1: T},), target="interpret")
    assert len(exe.plan.regions) == 3  # gate, up (+ silu * mul), down
    fused = [r for r in exe.plan.regions if any(o.target == "aten.mul.Tensor" for o in r.ops)]
    assert len(fused) == 1 and fused[0].kind == RegionKind.MATMUL
    assert all(k.kind == "triton" for k in _kernels(exe))
    for t in (9, 33):
        x = torch.randn(1, t, 32)
        with torch.no_grad():
            assert rel_err(exe(x), model(x)) <= 1e-5


class FusedGateUp(torch.nn.Module):
    """gpt-fast's MLP: one [2F, D] projection chunked into gate and up halves."""

    def __init__(self, d=32, f=24, bias=False):
        super().__init__()
        self.w13 = torch.nn.Linear(d, 2 * f, bias=bias)
        self.w2 = torch.nn.Linear(f, d, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_after_chunk_streams_both_halves_in_one_gemv(bias):
    """Decode: the epilogue reads the product F columns right of the tile, so one GEMV
    program streams both column blocks of the weight (the product is never stored)."""
    model = FusedGateUp(bias=bias)
    x = torch.randn(1, 1, 32)
    exe = kiln.compile(model, (x,), target="interpret")
    fused = [r for r in exe.plan.regions if any(o.target == "aten.mul.Tensor" for o in r.ops)]
    assert len(fused) == 1 and fused[0].kind == RegionKind.MATMUL
    kernel = exe.program.kplan.kernels[fused[0].name]
    assert kernel.kind == "triton", fused[0].notes
    assert kernel.spec.meta["form"] == "gemv" and kernel.spec.meta["column_shifts"] == [24]
    with torch.no_grad():
        assert rel_err(exe(x), model(x)) <= 1e-5


def test_swiglu_after_chunk_splits_a_tiled_product_from_its_epilogue():
    """Prefill: the tiled product runs as its own region and silu(gate) * up as a
    pointwise kernel after it, rather than the whole region as torch ops."""
    model = FusedGateUp(bias=True)
    x = torch.randn(1, 9, 32)
    exe = kiln.compile(model, (x,), dynamic_shapes=({1: T},), target="interpret")
    epilogue = next(r for r in exe.plan.regions if any(o.target == "aten.mul.Tensor"
                                                       for o in r.ops))
    assert epilogue.kind == RegionKind.POINTWISE
    assert any(n.startswith("split: the product") for n in epilogue.notes)
    assert all(k.kind == "triton" for k in exe.program.kplan.kernels.values())
    assert len(_kernels(exe)) == 2  # w13 alone, w2
    for t in (9, 33, 1):
        x = torch.randn(1, t, 32)
        with torch.no_grad():
            assert rel_err(exe(x), model(x)) <= 1e-5, t


class Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b.transpose(1, 2)) * 0.5


def test_bmm_with_transposed_operand_and_dynamic_rows():
    rows, cols = torch.export.Dim("rows", min=2, max=40), torch.export.Dim("cols", min=2, max=40)
    a, b = torch.randn(3, 5, 24), torch.randn(3, 6, 24)
    exe = kiln.compile(Bmm(), (a, b), dynamic_shapes=({1: rows}, {1: cols}), target="interpret")
    assert all(k.kind == "triton" for k in _kernels(exe))
    for s in (5, 19):
        a, b = torch.randn(3, s, 24), torch.randn(3, s + 1, 24)
        assert rel_err(exe(a, b), Bmm()(a, b)) <= 1e-5


class Proj(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(48, 40)

    def forward(self, x):
        return self.lin(x)


@pytest.mark.parametrize("bound,form", [(4, "gemv"), (None, "tiled")])
def test_decode_rows_get_the_gemv_form_and_unbounded_rows_the_tiled_one(bound, form):
    """M = batch * T: bounded small (decode) gives GEMV; no upper bound still works."""
    dim = torch.export.Dim("T", min=1, max=bound) if bound else torch.export.Dim("T", min=1)
    model = Proj()
    exe = kiln.compile(model, (torch.randn(2, 3, 48),), dynamic_shapes=({1: dim},),
                       target="interpret")
    (kernel,) = _kernels(exe)
    assert kernel.spec.meta["form"] == form
    if bound is None:
        assert kernel.spec.index_bits == 64  # an unbounded M may pass int32 offsets
    for t in (1, 3) if bound else (1, 3, 37):
        x = torch.randn(2, t, 48)
        with torch.no_grad():
            assert rel_err(exe(x), model(x)) <= 1e-5


def test_gemv_rounds_like_eager_in_half_precision():
    """One fp16 row: the GEMV (two or more take the tiled form in half precision)."""
    model = Proj().half()
    exe = kiln.compile(model, (torch.randn(1, 1, 48).half(),), target="interpret")
    assert _kernels(exe)[0].spec.meta["form"] == "gemv"
    dim = torch.export.Dim("T", min=1, max=2)
    two = kiln.compile(model, (torch.randn(1, 2, 48).half(),), dynamic_shapes=({1: dim},),
                       target="interpret")
    assert _kernels(two)[0].spec.meta["form"] == "tiled"
    x = torch.randn(1, 1, 48).half()
    with torch.no_grad():
        assert rel_err(exe(x), model(x)) <= 1e-2


def test_region_the_template_cannot_run_falls_back_to_torch():
    """An integer matmul has no tensor-core template: it runs extern, with a note."""

    class IntMM(torch.nn.Module):
        def forward(self, a, b):
            return torch.mm(a, b)

    a, b = torch.randint(0, 5, (4, 6)), torch.randint(0, 5, (6, 3))
    plan = kiln.compile(IntMM(), (a, b), compile_to="dispatch")
    with pytest.raises(CodegenUnsupported, match="a product in torch.int64"):
        matmul.generate(plan.regions[0], plan, get_target("interpret"))
    exe = kiln.compile(IntMM(), (a, b), target="interpret")
    assert torch.equal(exe(a, b), a @ b)
    assert exe.plan.regions[0].notes == [
        "extern: the matmul template declines: a product in torch.int64"]
    assert any(n.startswith("extern") for n in exe.plan.regions[0].notes)


class RopeAfterProjection(torch.nn.Module):
    """A decode q projection with RoPE's rotate_half right after it (transformers'
    Gemma 2 at decode): the epilogue reads the product half a head left and right."""

    def __init__(self, dim=64, heads=2, head_dim=32):
        super().__init__()
        self.q = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.heads, self.head_dim = heads, head_dim

    def forward(self, x, cos, sin):
        q = self.q(x).view(1, 1, self.heads, self.head_dim).transpose(1, 2)
        h = self.head_dim // 2
        return q * cos + torch.cat([-q[..., h:], q[..., :h]], dim=-1) * sin


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 32), (torch.bfloat16, 64)])
def test_an_epilogue_the_gemv_cannot_compute_runs_apart_not_extern(dtype, head_dim):
    """The product keeps its GEMV kernel and the RoPE runs as a pointwise kernel after
    it; the whole region had run as torch ops."""
    model = RopeAfterProjection(head_dim=head_dim).to(dtype)
    args = (torch.randn(1, 1, 64, dtype=dtype), torch.randn(1, 1, 1, head_dim, dtype=dtype),
            torch.randn(1, 1, 1, head_dim, dtype=dtype))
    exe = kiln.compile(model, args, target="interpret")
    kinds = sorted(r.kind.value for r in exe.plan.regions)
    assert kinds == ["matmul", "pointwise"], [r.notes for r in exe.plan.regions]
    assert not any(n.startswith("extern") for r in exe.plan.regions for n in r.notes)
    with torch.no_grad():
        assert rel_err(exe(*args), model(*args)) < (1e-5 if dtype == torch.float32 else 1e-2)


class RopeAfterGroupedProjections(torch.nn.Module):
    """q, k and v projections of one normed x, RoPE's rotate_half on q right after its
    product (transformers' Gemma 2 with eager attention at decode)."""

    def __init__(self, dim=64, heads=2, kv_heads=1, head_dim=32):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim, eps=1e-6)
        self.q = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.k = torch.nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = torch.nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.heads, self.head_dim = heads, head_dim

    def forward(self, x, cos, sin):
        x = self.norm(x)
        q = self.q(x).view(1, 1, self.heads, self.head_dim).transpose(1, 2)
        h = self.head_dim // 2
        q = q * cos + torch.cat([-q[..., h:], q[..., :h]], dim=-1) * sin
        return q, self.k(x), self.v(x)


@pytest.mark.parametrize("dtype,head_dim", [(torch.float32, 32), (torch.bfloat16, 64)])
def test_grouped_siblings_keep_one_gemv_when_an_epilogue_comes_apart(dtype, head_dim):
    """The q / k / v GEMVs stay one launch, q's RoPE runs as a pointwise kernel after
    it; the group had come apart into three GEMVs (and the RoPE kernel)."""
    model = RopeAfterGroupedProjections(head_dim=head_dim).to(dtype)
    args = (torch.randn(1, 1, 64, dtype=dtype), torch.randn(1, 1, 1, head_dim, dtype=dtype),
            torch.randn(1, 1, 1, head_dim, dtype=dtype))
    exe = kiln.compile(model, args, target="interpret")
    kinds = sorted(r.kind.value for r in exe.plan.regions)
    assert kinds == ["matmul", "pointwise"], [r.notes for r in exe.plan.regions]
    (gemv,) = [r for r in exe.plan.regions if r.kind.value == "matmul"]
    assert len(gemv.outputs) == 3 and any("siblings stay grouped" in n for n in gemv.notes)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    with torch.no_grad():
        for got, ref in zip(exe(*args), model(*args), strict=True):
            assert rel_err(got, ref) < tol


def test_static_single_row_epilogue_uses_the_gemv_template():
    """M == 1 (a decode-only compile): the epilogue reads the product at row 0 by
    broadcasting, which is the tile's own row; the region must still be generated."""
    import kiln

    mlp = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.SiLU(),
                              torch.nn.Linear(96, 64, bias=False))
    x = torch.randn(1, 1, 64)
    exe = kiln.compile(mlp, (x,), target="interpret")
    kernels = [exe.program.kplan.kernels[r.name] for r in exe.plan.regions]
    assert [k.kind for k in kernels] == ["triton", "triton"]
    assert [k.spec.meta["form"] for k in kernels] == ["gemv", "gemv"]
    x = torch.randn(1, 1, 64)
    torch.testing.assert_close(exe(x), mlp(x), rtol=1e-5, atol=1e-5)


class MatMul(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


class BatchedMatMul(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b)


class ProductMinusInput(torch.nn.Module):
    """The epilogue broadcasts the product: [M, 1] - [M, K] is [M, K]."""

    def forward(self, x, w):
        return (x @ w) - x


# size-1 M, N or K: the index maps read such a dim at the constant 0, so the template
# must broadcast the operands to whole tiles and widen the store (GEMV and tiled forms)
SIZE_ONE = {
    "n1_gemv": (MatMul, [(2, 3, 4), (4, 1)]),
    "n1_tiled": (MatMul, [(37, 4), (4, 1)]),
    "k1_through_a_view": (MatMul, [(3, 4, 1), (1, 6)]),
    "m1_n1": (MatMul, [(1, 3), (3, 1)]),
    "bmm_n1": (BatchedMatMul, [(3, 5, 4), (3, 4, 1)]),
    "linear_n1_bias": (lambda: torch.nn.Linear(6, 1), [(40, 6)]),
    "broadcast_epilogue": (ProductMinusInput, [(1, 5), (5, 1)]),
    "broadcast_epilogue_tiled": (ProductMinusInput, [(20, 5), (5, 1)]),
}


@pytest.mark.parametrize("case", SIZE_ONE)
def test_size_one_dims_match_eager(case):
    make, shapes = SIZE_ONE[case]
    model = make()
    exe = kiln.compile(model, tuple(torch.randn(s) for s in shapes), target="interpret")
    assert [k.kind for k in _kernels(exe)] == ["triton"]
    args = tuple(torch.randn(s) for s in shapes)
    with torch.no_grad():
        assert rel_err(exe(*args), model(*args)) <= 1e-5


@pytest.mark.parametrize("case", SIZE_ONE)
def test_size_one_dims_compile_for_sm90_without_fallback(case):
    import warnings

    from kiln.codegen.autotune.tuner import TuningWarning

    make, shapes = SIZE_ONE[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TuningWarning)
        exe = kiln.compile(make(), tuple(torch.randn(s) for s in shapes),
                           target="cuda:sm_90", options={"tune": "none"})
    (region,) = [r for r in exe.plan.regions if r.kind == RegionKind.MATMUL]
    assert not any(n.startswith("extern") for n in region.notes), region.notes
    assert exe.program.kplan.kernels[region.name].kind == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SIZE_ONE)
def test_size_one_dims_on_the_gpu(case, dtype):
    """The same shapes on real kernels, generated ones forced (tune none: no extern
    candidate can win and hide a wrong kernel); outputs poisoned by fresh inputs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    make, shapes = SIZE_ONE[case]
    model = make().to("cuda", dtype)
    exe = kiln.compile(model, tuple(torch.randn(s, device="cuda", dtype=dtype) for s in shapes),
                       target="cuda", options={"tune": "none"})
    assert [k.kind for k in _kernels(exe)] == ["triton"]
    for _ in range(2):
        args = tuple(torch.randn(s, device="cuda", dtype=dtype) for s in shapes)
        with torch.no_grad():
            ref = model(*args)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert rel_err(exe(*args).double(), ref.double()) <= tol
