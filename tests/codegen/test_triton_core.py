"""The Triton core: a KernelSpec compiles for every GPU target without a GPU, reports
its real resources, round-trips through JSON, and runs (interpreter here, binary on GPU)."""

import pytest
import torch

from kiln.codegen.build.compiler import Binary, compile_binary
from kiln.codegen.build.spec import Config, KernelArg, KernelSpec
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.symbolic import symbol
from kiln.target import get_target

SOURCE = '''import triton
import triton.language as tl


@triton.jit
def axpy(x_ptr, y_ptr, out_ptr, n, alpha: tl.constexpr, XBLOCK: tl.constexpr):
    offs = tl.program_id(0) * XBLOCK + tl.arange(0, XBLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, alpha * x + y, mask=mask)
'''


def axpy_spec(dtype=torch.float32) -> KernelSpec:
    s0 = symbol("s0")
    return KernelSpec(
        name="axpy", source=SOURCE,
        args=[KernelArg("x_ptr", "tensor", "x", dtype=dtype),
              KernelArg("y_ptr", "tensor", "y", dtype=dtype),
              KernelArg("out_ptr", "tensor", "out", dtype=dtype),
              KernelArg("n", "size", expr=s0 * 3),
              KernelArg("alpha", "constexpr", expr=2.0)],
        tunables=["XBLOCK"], grid=("cdiv(n, XBLOCK)",),
        configs=[Config.make(4, 1, XBLOCK=1024), Config.make(8, 1, XBLOCK=2048)],
        default=Config.make(4, 1, XBLOCK=64), template="pointwise",
    )


@pytest.mark.parametrize("target", ["cuda:sm_90", "cuda:sm_80", "rocm:gfx942"])
def test_compiles_without_gpu_and_reports_resources(target):
    tgt = get_target(target)
    b = compile_binary(axpy_spec(), Config.make(4, 1, XBLOCK=1024), tgt)
    assert b.resources.shared <= tgt.shared_mem_per_block
    assert b.resources.registers and 0 < b.resources.registers <= tgt.registers_per_thread
    assert b.resources.spills == 0
    assert b.resources.threads == 4 * tgt.warp_size


def test_binary_save_load_roundtrip(tmp_path):
    b = compile_binary(axpy_spec(), Config.make(4, 1, XBLOCK=1024), get_target("cuda:sm_90"))
    entry = b.save(tmp_path, "k0")
    b2 = Binary.load(tmp_path, entry)
    assert b2.asm["cubin"] == b.asm["cubin"] and b2.resources == b.resources


def test_spec_json_roundtrip():
    spec = axpy_spec()
    again = KernelSpec.from_json(spec.to_json())
    assert again.source_hash == spec.source_hash
    assert again.grid_for({"n": 3000}, again.configs[0]) == (3, 1, 1)


def test_interpreter_runs_kernel_with_tail():
    k = TritonKernel(None, axpy_spec(), Config.make(4, 1, XBLOCK=64), interpret=True)
    x, y = torch.randn(7, 3), torch.randn(7, 3)
    out = torch.full((7, 3), float("nan"))
    k.run({"x": x, "y": y}, {"out": out}, {"s0": 7})
    torch.testing.assert_close(out, 2 * x + y)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_binary_launches_on_gpu(dtype):
    tgt = get_target("cuda")
    spec = axpy_spec(dtype)
    cfg = Config.make(4, 1, XBLOCK=1024)
    k = TritonKernel(None, spec, cfg, compile_binary(spec, cfg, tgt))
    x = torch.randn(1001, 3, device="cuda", dtype=dtype)
    y = torch.randn(1001, 3, device="cuda", dtype=dtype)
    out = torch.full_like(x, float("nan"))
    k.run({"x": x, "y": y}, {"out": out}, {"s0": 1001})
    torch.testing.assert_close(out, 2 * x + y)
