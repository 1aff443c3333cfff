"""The GEMV form with an RMSNorm folded in (kiln.dispatch.fold_rmsnorm): under Triton's
interpreter at decode against eager (fp32 1e-5, fp16 1e-2), split K included, and
compiled for sm_90 without a GPU."""

import re

import pytest
import torch

import kiln
from kiln.bench import subject
from kiln.codegen.build.compiler import compile_binary, disassemble
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel, scratch_buffer
from kiln.codegen.templates.matmul import template as matmul
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import RegionKind
from kiln.target import get_target
from tests.dispatch.test_fold_rmsnorm import NormAlsoAdded, NormLinear, NormQKV, NormSwiGLU
from tests.helpers import assert_close_tree, rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16])


def _compile(model, args, dtype, **kw):
    model = model.to(dtype).eval()
    args = tuple(a.to(dtype) for a in args)
    return model, args, kiln.compile(model, args, target="interpret", **kw)


def _matmul_kernels(exe):
    kernels = [exe.program.kplan.kernels[r.name] for r in exe.plan.regions
               if r.kind == RegionKind.MATMUL]
    assert all(isinstance(k, TritonKernel) for k in kernels), [
        r.notes for r in exe.plan.regions]
    return kernels


def _folded(exe):
    return [k for k in _matmul_kernels(exe) if k.spec.meta["row_norm"]]


@DTYPES
@pytest.mark.parametrize("rows,dim", [(1, 64), (1, 96), (3, 96)])  # padded rows, a K tail
def test_norm_then_linear_with_bias(dtype, rows, dim):
    """fp16 products of more than one row take the tiled form: the norm stays apart."""
    model, args, exe = _compile(NormLinear(dim), (10 * torch.randn(1, rows, dim),), dtype)
    if dtype == torch.float16 and rows > 1:
        assert not _folded(exe) and len(exe.plan.regions) == 2
    else:
        (k,) = _folded(exe)
        assert k.spec.meta["form"] == "gemv" and len(exe.plan.regions) == 1
    with torch.no_grad():
        assert_close_tree(exe(*args), model(*args), TOL[dtype])


@DTYPES
def test_one_norm_into_three_projections(dtype):
    model, args, exe = _compile(NormQKV(), (torch.randn(1, 1, 64),), dtype)
    (k,) = _folded(exe)  # grouped siblings (dispatch/group_siblings.py): one kernel
    assert len(k.spec.meta["siblings"]) == 3 and len(exe.plan.regions) == 1
    with torch.no_grad():
        assert_close_tree(exe(*args), model(*args), TOL[dtype])


@DTYPES
def test_norm_into_fused_gate_up_with_swiglu(dtype):
    model, args, exe = _compile(NormSwiGLU(), (torch.randn(1, 1, 64),), dtype)
    (k,) = _folded(exe)
    assert k.spec.meta["column_shifts"]  # gate and up columns in one program
    with torch.no_grad():
        assert_close_tree(exe(*args), model(*args), TOL[dtype])


@DTYPES
def test_norm_also_added_stays_apart_and_matches(dtype):
    model, args, exe = _compile(NormAlsoAdded(), (torch.randn(1, 1, 64),), dtype)
    assert not _folded(exe)
    assert [r.label for r in exe.plan.regions].count("rmsnorm") == 1
    with torch.no_grad():
        assert_close_tree(exe(*args), model(*args), TOL[dtype])


@DTYPES
def test_gemma_norm_cast_back_with_type_as(dtype):
    model, args, exe = _compile(NormLinear(offset=True, type_as=True),
                                (torch.randn(1, 1, 64),), dtype)
    assert len(_folded(exe)) == 1 and len(exe.plan.regions) == 1
    with torch.no_grad():
        assert_close_tree(exe(*args), model(*args), TOL[dtype])


def test_gemma_offset_weight_and_dynamic_rows():
    t = torch.export.Dim("B", min=1, max=8)
    model, args, exe = _compile(NormLinear(offset=True), (torch.randn(2, 1, 64),),
                                torch.float32, dynamic_shapes=({0: t},))
    assert len(_folded(exe)) == 1
    with torch.no_grad():
        for b in (1, 5, 8):
            x = torch.randn(b, 1, 64)
            assert_close_tree(exe(x), model(x), 1e-5)


@DTYPES
def test_bench_subject_decode_step(dtype):
    s = subject.PRESETS["tiny"].with_(layers=1)
    model = subject.build(s, dtype, "cpu")
    args = (torch.tensor([[7]]), torch.tensor([5]))
    exe = kiln.compile(model, args, target="interpret")
    assert len(_folded(exe)) == 3  # attention's, the MLP's and the final norm
    with torch.no_grad():
        ref = subject.build(s, dtype, "cpu")(*args)
    assert rel_err(exe(*args), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype,rows,dim", [(torch.float32, 3, 512), (torch.float16, 1, 200)])
def test_split_k_parts_carry_the_sums_of_squares(dtype, rows, dim):
    """Each part is a partial dot product and a partial sum of x^2: the last program
    sums both, then scales. Forced splits against the region's torch ops."""
    model = NormLinear(dim, 40).to(dtype)
    plan = kiln.compile(model, (torch.randn(1, rows, dim, dtype=dtype),), target="interpret",
                        compile_to="dispatch")
    (region,) = plan.regions
    spec = matmul.generate(region, plan, get_target("interpret"))
    config = Config.make(2, 1, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4)
    kernel = TritonKernel(region, spec, config, interpret=True)
    assert spec.grid_for(kernel.sizes({}), config)[2] == 4
    inputs = {v: 10 * torch.randn(tuple(plan.values[v].shape), dtype=plan.values[v].dtype)
              for v in region.inputs}
    out = region.outputs[0]
    shape, odt = tuple(plan.values[out].shape), plan.values[out].dtype
    ref, got = {out: torch.empty(shape, dtype=odt)}, {out: torch.empty(shape, dtype=odt)}
    TorchKernel(region, "cpu").run(inputs, ref, {})
    kernel.run(inputs, got, {})
    assert rel_err(got[out], ref[out]) <= TOL[dtype], rel_err(got[out], ref[out])
    counts = scratch_buffer(spec.scratch[1], 1, 1, "cpu")
    assert not counts.any()  # zeroed for the next launch


def test_sm90_folded_gemv_streams_weights_as_the_plain_one_does():
    """Compiled for sm_90 (no GPU): the norm adds no spills and keeps the weight's
    16-byte loads; its row scale runs once per program, after the K loop."""
    sm90 = get_target("cuda:sm_90")

    def spec_of(model):
        plan = kiln.compile(model, (torch.randn(1, 1, 4096).half(),), target=sm90,
                            compile_to="dispatch")
        (region,) = [r for r in plan.regions if r.kind == RegionKind.MATMUL]
        return matmul.generate(region, plan, sm90)

    folded = spec_of(NormLinear(4096, 1024, bias=False).half())
    plain = spec_of(torch.nn.Linear(4096, 1024, bias=False).half())
    assert folded.meta["row_norm"] and not plain.meta["row_norm"]
    loop = folded.source.split("for k0")[1].split("rm2 =")[0]
    assert "rsqrt" not in loop and "tl.sum(ss" not in loop
    for config in (folded.default, Config.make(4, 1, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1)):
        sass = disassemble(compile_binary(folded, config, sm90))
        if sass is None:
            pytest.skip("Triton ships no cuobjdump here")
        base = disassemble(compile_binary(plain, config, sm90))
        assert not re.search(r"\b(LDL|STL)\b", sass)
        assert sass.count("LDG.E.128") >= base.count("LDG.E.128") > 0
