"""The emitter's contract, as a template (matmul, attention) uses it: the template owns
some values (overrides), the emitter computes the region's other ops at the template's
tile index, and stores outputs. Run in Triton's interpreter against eager."""

import pytest
import torch

import kiln
from kiln.codegen.build.source import load_kernel
from kiln.codegen.expr.emit import Emitter, module_source
from kiln.codegen.expr.indexing import Lin, Var, linearize, reshape_index
from kiln.codegen.expr.kernel_args import KernelArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, Val, mask_of
from kiln.ir.plan import RegionKind
from kiln.target import TARGETS
from tests.helpers import rel_err


class LinearReluResidual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)
        self.scale = torch.nn.Parameter(torch.randn(8))

    def forward(self, x, r):
        return torch.relu(self.lin(x)) * self.scale + r


def _matmul_region():
    model = LinearReluResidual()
    x, r = torch.randn(2, 3, 16), torch.randn(2, 3, 8)
    T = torch.export.Dim("T", min=1, max=64)
    plan = kiln.compile(model, (x, r), dynamic_shapes=({1: T}, {1: T}), compile_to="dispatch")
    region = next(rg for rg in plan.regions if rg.kind == RegionKind.MATMUL)
    return model, plan, region


def _epilogue_kernel(plan, region):
    """A toy 'template': acc (the addmm result) is read from a pointer, the emitter fuses
    relu, the per-column scale and the residual add, and stores the region output."""
    mm = region.anchor()
    M, N = mm.shape
    rm, rn = Var("rm", M), Var("rn", N)
    tile = (Lin.of(rm), Lin.of(rn))
    args = KernelArgs()
    acc_ptr = args.tensor("acc_in", torch.float32, mm.shape)
    names = frozenset({"rm", "rn"})
    overrides = {mm.name: lambda idx: Val("acc", torch.float32, names)
                 if all(a.equals(b) for a, b in zip(idx, tile)) else None}
    em = Emitter(region, plan, args, TARGETS["interpret"], overrides=overrides)
    mask = mask_of(Cond("mask_m", frozenset({"rm"})), Cond("mask_n", frozenset({"rn"})))
    out = region.outputs[0]
    idx = reshape_index(tile, mm.shape, plan.values[out].shape)
    em.store(out, idx, em.value(out, idx, mask), mask)
    m_code = args.dim(M)
    body = ["rm = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]",
            "rn = tl.arange(0, BN)[None, :]",
            f"mask_m = rm < {m_code}", f"mask_n = rn < {N}",
            f"acc = tl.load({acc_ptr} + ({em.code(linearize(tile, mm.shape))}), "
            "mask=mask_m & mask_n, other=0)"] + em.lines
    src = module_source("epilogue", args.names() + ["BM: tl.constexpr", "BN: tl.constexpr"],
                        body, em.helpers, TARGETS["interpret"], args.describe())
    return src, args, em


def test_template_fuses_epilogue_through_override():
    model, plan, region = _matmul_region()
    src, args, em = _epilogue_kernel(plan, region)
    code = "\n".join(em.lines)
    assert "acc" in code
    # the scale row is read at rn only: its load carries only the n mask
    assert "mask=mask_n," in code
    fn = load_kernel(src, "epilogue", interpret=True)
    x, r = torch.randn(2, 5, 16), torch.randn(2, 5, 8)
    acc = (x.reshape(10, 16) @ model.lin.weight.T + model.lin.bias).detach().contiguous()
    out = torch.empty(2, 5, 8)
    tensors = {"acc_in": acc, "x": x, "r": r, "p_scale": model.scale.detach(),
               region.outputs[0]: out}
    call = []
    for a in args.kernel_args():
        call.append(tensors[a.value] if a.kind == "tensor" else
                    kiln.ir.symbolic.evaluate(a.expr, {"s27": 5}))
    fn[(2,)](*call, BM=8, BN=8)
    assert rel_err(out, model(x, r)) < 1e-6


def test_override_refusing_an_index_is_unsupported_not_wrong():
    _, plan, region = _matmul_region()
    mm = region.anchor()
    em = Emitter(region, plan, KernelArgs(), TARGETS["interpret"],
                 overrides={mm.name: lambda idx: None})
    out = region.outputs[0]
    idx = tuple(Lin.of(Var(f"i{k}", d)) for k, d in enumerate(plan.values[out].shape))
    with pytest.raises(CodegenUnsupported, match=f"%{mm.name} is not available at index"):
        em.value(out, idx)
