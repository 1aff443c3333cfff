"""Artifacts with Triton kernels: source + config for the interpreter, binaries for GPUs.

A test generator turns `x * 2 + 1` regions into a hand-written Triton kernel, so
these tests do not depend on which real generators exist.
"""

import json

import pytest
import sympy
import torch

import kiln
from kiln.codegen.build.spec import Config, KernelArg, KernelSpec
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.select_kernels import TEMPLATES
from kiln.errors import ArtifactError, TargetError
from kiln.ir.plan import RegionKind
from kiln.ir.symbolic import numel

SOURCE = '''import triton
import triton.language as tl


@triton.jit
def affine(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * 2.0 + 1.0, mask=mask)
'''


def affine_generator(region, plan, target):
    if [o.target for o in region.ops] != ["aten.mul.Tensor", "aten.add.Tensor"]:
        raise CodegenUnsupported("not x * 2 + 1")
    (src,), (out,) = region.inputs, region.outputs
    n = numel(plan.values[src].shape)
    config = Config.make(BLOCK=64)
    return KernelSpec(
        "affine", SOURCE,
        [KernelArg("x_ptr", "tensor", src, dtype=torch.float32),
         KernelArg("out_ptr", "tensor", out, dtype=torch.float32),
         KernelArg("n", "size", expr=n)],
        ["BLOCK"], ("cdiv(n, BLOCK)",), [config], config, "pointwise")


class Affine(torch.nn.Module):
    def forward(self, x):
        return x * 2.0 + 1.0


@pytest.fixture
def affine_gen(monkeypatch):
    monkeypatch.setitem(TEMPLATES, RegionKind.POINTWISE, affine_generator)


def _compile(target):
    T = kiln.Dim("T", min=1, max=4096)
    return kiln.compile(Affine(), (torch.randn(5, 3),), dynamic_shapes=({0: T},),
                        target=target, options={"tune": "none"})


def test_interpret_artifact_keeps_source_and_config(affine_gen, tmp_path):
    exe = _compile("interpret")
    assert isinstance(exe.program.kplan.kernels["r0"], TritonKernel)
    exe.save(tmp_path / "a.kiln")
    entry = json.loads((tmp_path / "a.kiln" / "manifest.json").read_text())["kernels"]["r0"]
    assert entry["kind"] == "triton" and "tl.store" in entry["spec"]["source"]
    assert entry["config"] == {"params": {"BLOCK": 64}, "num_warps": 4, "num_stages": 1}
    assert not (tmp_path / "a.kiln" / "kernels").exists()  # the interpreter needs no binary
    loaded = kiln.load(tmp_path / "a.kiln")
    kernel = loaded.program.kplan.kernels["r0"]
    assert isinstance(kernel, TritonKernel) and kernel.interpret
    assert isinstance(kernel.spec.args[2].expr, sympy.Expr)
    x = torch.randn(77, 3)
    assert torch.equal(loaded(x), exe(x))
    assert torch.equal(loaded(x), x * 2.0 + 1.0)


def _files(artifact, region: str) -> dict:
    """The files of `region`'s kernel binary, as the manifest names them."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    return manifest["kernels"][region]["binary"]["files"]


class TwoAffines(torch.nn.Module):
    def forward(self, x, y):
        return x * 2.0 + 1.0, y * 2.0 + 1.0  # two regions that run one kernel


def test_a_binary_several_regions_run_is_stored_and_loaded_once(affine_gen, tmp_path):
    T = kiln.Dim("T", min=1, max=4096)
    x, y = torch.randn(8), torch.randn(8)
    exe = kiln.compile(TwoAffines(), (x, y), dynamic_shapes=({0: T}, {0: T}),
                       target="cuda:sm_90")
    affine = [r.name for r in exe.plan.regions
              if getattr(exe.program.kplan.kernels[r.name], "binary", None) is not None]
    assert len(affine) == 2
    exe.save(tmp_path / "g.kiln")
    first, second = (_files(tmp_path / "g.kiln", r) for r in affine)
    assert first == second
    assert len(list((tmp_path / "g.kiln" / "kernels").glob("*.cubin"))) == 1
    kernels = kiln.load(tmp_path / "g.kiln").program.kplan.kernels
    assert kernels[affine[0]].binary is kernels[affine[1]].binary


def test_gpu_artifact_compiled_without_a_gpu(affine_gen, tmp_path):
    exe = _compile("cuda:sm_90")
    binary = exe.program.kplan.kernels["r0"].binary
    exe.save(tmp_path / "g.kiln")
    assert (tmp_path / "g.kiln" / "kernels" / _files(tmp_path / "g.kiln", "r0")["cubin"]
            ).read_bytes() == binary.asm["cubin"]
    loaded = kiln.load(tmp_path / "g.kiln")
    got = loaded.program.kplan.kernels["r0"].binary
    assert got.asm["cubin"] == binary.asm["cubin"] and got.resources == binary.resources
    assert got.metadata == binary.metadata
    assert "tl.store" in loaded.explain(kernels=True)
    if not torch.cuda.is_available():
        with pytest.raises(TargetError, match="compiled for cuda:sm_90.*no GPU"):
            loaded(torch.randn(4, 3))


def test_gpu_binaries_from_another_triton_are_refused(affine_gen, tmp_path):
    _compile("cuda:sm_90").save(tmp_path / "g.kiln")
    path = tmp_path / "g.kiln" / "manifest.json"
    m = json.loads(path.read_text())
    m["versions"]["triton"] = "2.0.0"
    path.write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match="compiled by Triton 2.0.0"):
        kiln.load(tmp_path / "g.kiln")


def test_a_corrupt_kernel_file_is_named_not_the_manifest(affine_gen, tmp_path):
    _compile("cuda:sm_90").save(tmp_path / "g.kiln")
    (tmp_path / "g.kiln" / "kernels" / _files(tmp_path / "g.kiln", "r0")["json"]
     ).write_text("{garbage")
    with pytest.raises(ArtifactError, match="cannot read the kernel binary of region r0"):
        kiln.load(tmp_path / "g.kiln")


@pytest.mark.gpu
def test_gpu_artifact_round_trip_on_the_gpu(affine_gen, tmp_path):
    exe = _compile("cuda")
    exe.save(tmp_path / "c.kiln")
    loaded = kiln.load(tmp_path / "c.kiln")
    x = torch.randn(1000, 3, device="cuda")
    assert torch.equal(loaded(x), exe(x))
    assert torch.equal(loaded(x), x * 2.0 + 1.0)
