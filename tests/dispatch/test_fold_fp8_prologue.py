"""A pointwise region read only as x by a one-token fp8 linear becomes that linear's
prologue (kiln.dispatch.fold_fp8_prologue): the fp8 decode layer's SwiGLU is computed
where the down projection's GEMV reads x, one kernel fewer a layer, and the steps
match eager's (the generated kernels, interpret target)."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.bench import subject
from kiln.ir.plan import RegionKind
from kiln.models.fp8 import Fp8Linear
from tests.helpers import rel_err

NOTE = "computed where the fp8 GEMV reads its x"


def _folded(exe):
    return [r for r in exe.plan.regions if any(NOTE in n for n in r.notes)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fp8_swiglu_is_the_down_projections_prologue(dtype):
    s = subject.PRESETS["tiny"].with_(layers=2)
    base = subject.build(s, dtype, "cpu")
    args = (torch.zeros(1, 1, dtype=torch.long), torch.tensor([5]))
    exe = kiln.compile(subject.quantize_fp8(base), args, target="interpret")
    cpu = kiln.compile(subject.quantize_fp8(base), args, target="cpu")
    folded = _folded(exe)
    assert len(folded) == s.layers and all(r.kind == RegionKind.EXTERN for r in folded)
    assert not any(r.kind == RegionKind.POINTWISE for r in exe.plan.regions)
    assert not _folded(cpu)  # the CPU target runs torch ops: nothing to save
    eager = subject.quantize_fp8(base)
    gen = torch.Generator().manual_seed(0)
    for pos in range(5, 8):
        tok = torch.randint(0, s.vocab, (1, 1), generator=gen)
        got, want = exe(tok, torch.tensor([pos])), eager(tok, torch.tensor([pos]))
        assert rel_err(got, want) <= (1e-5 if dtype == torch.float32 else 2e-2)


class Gated(torch.nn.Module):
    """silu(g) * u into an fp8 down projection, and the same product read twice."""

    def __init__(self, twice=False):
        super().__init__()
        torch.manual_seed(0)
        self.down = Fp8Linear.from_linear(torch.nn.Linear(256, 128, bias=False))
        self.twice = twice

    def forward(self, gu):
        g, u = gu.chunk(2, -1)
        h = F.silu(g) * u
        return (self.down(h), h * 2) if self.twice else self.down(h)


def test_a_product_with_another_reader_or_many_tokens_stays_apart():
    one, many = torch.randn(1, 512), torch.randn(6, 512)
    assert len(_folded(kiln.compile(Gated(), (one,), target="interpret"))) == 1
    for model, x in ((Gated(twice=True), one), (Gated(), many)):
        exe = kiln.compile(model, (x,), target="interpret")
        assert not _folded(exe)
        assert any(r.kind == RegionKind.POINTWISE for r in exe.plan.regions)
        for got, want in zip(*(torch.utils._pytree.tree_leaves(o)
                               for o in (exe(x), model(x)))):
            assert rel_err(got, want) <= 1e-5
