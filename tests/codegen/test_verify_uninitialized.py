"""The tuner's output check against a region that returns memory it never wrote.

Mistral 4's latent attention builds its key as `k = empty(...)`, `k[..., :8] = nope`,
then `k[..., 8:] = rope`; the first write became a copy region returning the whole
`empty`, half of it unwritten. On an H200 the tuner judged every fast candidate of that
region wrong (relative error 0.66-1.0 against the torch form) and quarantined them: its
torch form returned whatever the allocator held where the kernel writes zeros. The check
now runs the torch form with uninitialised creations zeroed, as a generated kernel
reads them.
"""

import torch

from kiln.codegen.autotune.verify import mismatch, outputs
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.copy import generate_copy
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, RegionKind, Role, TensorValue
from kiln.target import get_target

F32 = torch.float32


def half_written() -> tuple[Region, DispatchPlan]:
    """out = slice_scatter(empty(4, 6), x, dim 1, [0, 3)): columns 3-5 never written."""
    ops = [Op("e", "aten.empty.memory_format", ([4, 6],),
              {"dtype": F32, "device": torch.device("cpu"), "pin_memory": False},
              (4, 6), F32),
           Op("s", "aten.slice.Tensor", (Ref("e"), 1, 0, 3), {}, (4, 3), F32),
           Op("c", "aten.copy.default", (Ref("s"), Ref("x")), {}, (4, 3), F32),
           Op("out", "aten.slice_scatter.default", (Ref("e"), Ref("c"), 1, 0, 3), {},
              (4, 6), F32)]
    values = {"x": TensorValue("x", (4, 3), F32, Role.INPUT),
              "out": TensorValue("out", (4, 6), F32, Role.OUTPUT)}
    region = Region("r0", RegionKind.COPY, ops, ["x"], ["out"])
    return region, DispatchPlan({}, values, [region], ["x"], ["out"])


def test_the_checked_form_reads_uninitialised_memory_as_zeros():
    region, _ = half_written()
    x = torch.randn(4, 3)
    like = {"out": torch.full((4, 6), float("nan"))}
    got = outputs(TorchKernel(region, zeroed=True), {"x": x}, like, {})["out"]
    assert torch.equal(got[:, :3], x) and torch.equal(got[:, 3:], torch.zeros(4, 3))


def test_a_generated_kernel_matches_the_checked_form_where_memory_is_unwritten():
    region, plan = half_written()
    spec = generate_copy(region, plan, get_target("interpret"))
    x = torch.randn(4, 3)
    like = {"out": torch.empty(4, 6)}
    want = outputs(TorchKernel(region, zeroed=True), {"x": x}, like, {})
    for config in spec.configs or [spec.default]:
        kernel = TritonKernel(region, spec, config, interpret=True)
        got = outputs(kernel, {"x": x}, like, {})
        assert mismatch(got, want) is None, config
