"""A router's renormalisation of its top-k weights (the picked values' sum, the division
by it, casts) is computed by the topk kernel (dispatch/fold_topk_sum.py): one region,
eager's values and indices under the interpreter; sums it cannot hold stay apart."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err


class Router(torch.nn.Module):
    """Qwen-MoE / Mixtral's `norm_topk_prob` routing weights."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, logits):
        w = F.softmax(logits, dim=-1, dtype=torch.float)
        w, ids = torch.topk(w, self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return w.to(torch.bfloat16), ids


class Sums(torch.nn.Module):
    """The sum alone (no keepdim), read beside the values it sums."""

    def forward(self, x):
        w, ids = torch.topk(x, 3, dim=-1)
        return w, ids, w.sum(-1)


def _regions(exe):
    return [r.kind for r in exe.plan.regions]


@pytest.mark.parametrize("rows,width,k", [(1, 512, 10), (3, 60, 4), (5, 8, 2)])
def test_the_renormalised_weights_come_from_the_topk_kernel(rows, width, k):
    model = Router(k)
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows))
    exe = kiln.compile(model, (x,), target="interpret")
    assert _regions(exe) == [RegionKind.TOPK]
    assert any("sum of the picked values" in n for n in exe.plan.regions[0].notes)
    for seed in (1, 2):
        x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
        w, ids = exe(x)
        ew, eids = model(x)
        assert torch.equal(ids, eids) and w.dtype == torch.bfloat16
        assert rel_err(w.float(), ew.float()) <= 1e-2  # bf16 rounding of equal fp32
        assert rel_err(exe(x)[0].float(), w.float()) == 0


class OverRows(torch.nn.Module):
    """A topk down the columns (dim 0), its picks summed twice (keepdim and not)."""

    def forward(self, x):
        w, ids = torch.topk(x, 3, dim=0)
        return w / w.sum(0, keepdim=True), ids, w.sum(0)


class ManyPicks(torch.nn.Module):
    """k 40: over kiln's topk limit, so the region (its sum folded in) runs as torch ops."""

    def forward(self, x):
        w, ids = torch.topk(x, 40, dim=-1)
        return w / w.sum(-1, keepdim=True), ids


@pytest.mark.parametrize("model,shape,generated", [(OverRows(), (12, 5), True),
                                                   (ManyPicks(), (3, 100), False)])
def test_other_axes_two_sums_and_a_torch_topk(model, shape, generated):
    from kiln.codegen.build.triton_kernel import TritonKernel

    x = torch.randn(*shape)
    exe = kiln.compile(model, (x,), target="interpret")
    assert _regions(exe) == [RegionKind.TOPK]
    kernel = exe.program.kplan.kernels[exe.plan.regions[0].name]
    assert isinstance(kernel, TritonKernel) == generated
    for got, want in zip(exe(x), model(x)):
        assert rel_err(got.float(), want.float()) <= 1e-6


def test_a_sum_without_keepdim_is_stored_beside_the_values_it_sums():
    x = torch.randn(4, 20)
    exe = kiln.compile(Sums(), (x,), target="interpret")
    assert _regions(exe) == [RegionKind.TOPK]
    got, want = exe(x), Sums()(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert rel_err(got[2], want[2]) <= 1e-6


class OtherAxis(torch.nn.Module):
    def forward(self, x):
        w, ids = torch.topk(x, 2, dim=-1)
        return w.sum(0), ids


class ThroughAView(torch.nn.Module):
    def forward(self, x):
        w, ids = torch.topk(x, 2, dim=-1)
        return w / w.sum(-1).unsqueeze(-1), ids


@pytest.mark.parametrize("model", [OtherAxis(), ThroughAView()])
def test_sums_the_kernel_does_not_hold_stay_apart(model):
    """Over another axis (rows of other programs), or read through a view: not folded,
    still eager's result."""
    x = torch.randn(6, 16)
    exe = kiln.compile(model, (x,), target="interpret")
    assert RegionKind.REDUCTION in _regions(exe)
    for got, want in zip(exe(x), model(x)):
        assert rel_err(got.float(), want.float()) <= 1e-6


def test_the_cpu_target_keeps_torch_s_ops():
    exe = kiln.compile(Router(2), (torch.randn(2, 8),), target="cpu")
    assert RegionKind.REDUCTION in _regions(exe)
