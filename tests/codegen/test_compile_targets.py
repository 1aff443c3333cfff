"""Every op family's generated kernels compile for the GPU targets (no GPU needed): the
GPU forms (libdevice helpers, NaN-safe reductions, online softmax, atomics) are code
the interpreter never runs, so the real compilers check them here."""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.select_kernels import TEMPLATES
from kiln.target import TARGETS
from tests.codegen.gen_helpers import GENERATED
from tests.codegen.test_copy_kernels import Cache
from tests.codegen.test_pointwise_kernels import FloatMath, HalfChain
from tests.codegen.test_reduction_kernels import LARGE, SMALL, Normalizations, Reductions

T = torch.export.Dim("T", min=2, max=64)


def _models():
    """The families with GPU-only code paths (a few seconds of compiling each)."""
    x = torch.randn(3, 6, 9)
    h = torch.randn(2, 4, 12, dtype=torch.bfloat16)
    return [
        (FloatMath(), (torch.randn(3, 7, 5), torch.randn(5)), ({1: T}, None)),  # libdevice
        (HalfChain(), (h, h, h), None),  # bf16 rounding
        (Reductions((2,), True), (x,), ({1: SMALL},)),  # every reduction, persistent
        (Reductions((1,), False), (x,), ({1: LARGE},)),  # ... looped
        (Normalizations(), (torch.randn(2, 4, 12),), ({0: LARGE},)),  # online softmax
        (Cache(), (torch.randn(1, 3, 8), torch.arange(3), torch.randn(3, 4)),
         ({1: T}, {0: T}, {0: T})),  # in-place scatters, atomics
        (Unbounded(), (torch.randn(4, 8),), ({0: torch.export.Dim("N", min=2)},)),  # 64-bit
    ]


class Unbounded(torch.nn.Module):
    def forward(self, x):
        return x * 2, torch.softmax(x, -1)


@pytest.fixture(scope="module")
def plans():
    return [(type(m).__name__, kiln.compile(m, a, dynamic_shapes=d, compile_to="dispatch"))
            for m, a, d in _models()]


# sm_80 differs from sm_90 only in limits for these kernels; the Llama test covers it
@pytest.mark.parametrize("target", ["cuda:sm_90", "rocm:gfx942"])
def test_every_family_compiles_for_gpu_targets(plans, target):
    tgt = TARGETS[target]
    seen = set()
    for model, plan in plans:
        for region in plan.regions:
            if region.kind not in GENERATED:
                continue
            spec = TEMPLATES[region.kind](region, plan, tgt)
            assert spec is not None, (model, region.name, region.notes)
            if spec.source_hash in seen:
                continue
            seen.add(spec.source_hash)
            if model == "Unbounded":
                assert spec.index_bits == 64
            res = compile_binary(spec, spec.default, tgt).resources
            assert res.shared <= tgt.shared_mem_per_block
            if model != "FloatMath":  # sixty libdevice functions in one kernel do spill
                assert res.spills in (None, 0), (spec.name, res)
