"""Helpers for the generated-kernel tests: compile for the interpreter, check kernels."""

import torch
import torch.utils._pytree as pytree

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

GENERATED = (RegionKind.POINTWISE, RegionKind.REDUCTION, RegionKind.COPY)


def compile_interpret(model, args, dynamic_shapes=None, require_triton=True):
    """Compile for Triton's interpreter; every generated-kind region must get a kernel."""
    exe = kiln.compile(model, args, dynamic_shapes=dynamic_shapes, target="interpret")
    if require_triton:
        for r in exe.plan.regions:
            if r.kind in GENERATED:
                k = exe.program.kplan.kernels[r.name]
                assert isinstance(k, TritonKernel), (r.name, r.kind.value, r.notes)
    return exe


def triton_kernels(exe) -> list[TritonKernel]:
    return [k for k in exe.program.kplan.kernels.values() if isinstance(k, TritonKernel)]


def assert_matches(out, ref, tol: float, names=None) -> None:
    outs, refs = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        what = names[i] if names else i
        assert o.shape == r.shape and o.dtype == r.dtype, (what, o.shape, r.shape, o.dtype, r.dtype)
        if o.dtype == torch.bool or not o.is_floating_point():
            assert torch.equal(o, r), (what, o, r)
        else:
            assert torch.equal(o.isnan(), r.isnan()), (what, "NaN positions differ")
            inf = r.isinf()
            assert torch.equal(o.isinf(), inf) and torch.equal(o[inf], r[inf]), (what, "inf")
            o, r = o.nan_to_num(0.0, 0.0, 0.0), r.nan_to_num(0.0, 0.0, 0.0)
            assert rel_err(o, r) <= tol, (what, rel_err(o, r))
