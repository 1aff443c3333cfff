"""A cast that widens a matmul operand read by the product alone runs in the matmul's
kernel (dispatch/grouping.py `_widened_operand`): the kernel loads the narrow values and
widens them in registers, in the GEMV and the tiled form, and matches eager. Narrowing
casts, and casts something else reads too, keep a region of their own."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err


class Router(torch.nn.Module):
    """DeepSeek-V3's (HF's and kiln.models') router: fp32 scores of bf16 values."""

    def __init__(self, experts=40, dim=300):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(
            (torch.randn(experts, dim, generator=gen) * 0.05).bfloat16())

    def forward(self, x):
        return F.linear(x.float(), self.weight.float()).sigmoid()


def _regions(m, args, **kw):
    plan = kiln.compile(m, args, compile_to="dispatch", target="interpret", **kw)
    return [(r.kind, [o.target for o in r.ops]) for r in plan.regions]


@pytest.mark.parametrize("tokens", [1, 70])  # the GEMV form, the tiled form
def test_a_routers_casts_run_in_its_product_and_match_eager(tokens):
    m = Router()
    x = torch.randn(tokens, 300).bfloat16()
    ((kind, ops),) = _regions(m, (x,))
    assert kind == RegionKind.MATMUL and ops.count("aten._to_copy.default") == 2
    exe = kiln.compile(m, (x,), target="interpret")
    assert rel_err(exe(x), m(x)) <= 1e-6


def test_a_dynamic_token_count_takes_the_casts_too():
    m = Router()
    x = torch.randn(5, 300).bfloat16()
    dims = {"x": {0: torch.export.Dim("tokens", min=1, max=256)}}
    ((kind, _),) = _regions(m, (x,), dynamic_shapes=dims)
    assert kind == RegionKind.MATMUL
    exe = kiln.compile(m, (x,), target="interpret", dynamic_shapes=dims)
    for n in (1, 33):
        y = torch.randn(n, 300).bfloat16()
        assert rel_err(exe(y), m(y)) <= 1e-6


class UpcastScores(torch.nn.Module):
    """Attention scores in fp32 from fp16 q and k (eager attention's upcast)."""

    def forward(self, q, k):
        return torch.matmul(q.float(), k.float().transpose(-1, -2)).softmax(-1)


def test_a_batched_product_of_widened_operands():
    q, k = torch.randn(2, 3, 5, 16).half(), torch.randn(2, 3, 7, 16).half()
    kinds = [kind for kind, _ in _regions(UpcastScores(), (q, k))]
    assert RegionKind.POINTWISE not in kinds
    exe = kiln.compile(UpcastScores(), (q, k), target="interpret")
    assert rel_err(exe(q, k), UpcastScores()(q, k)) <= 1e-6


class Narrowed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(24, 32).bfloat16())

    def forward(self, x):
        return F.linear(x.bfloat16(), self.weight)


class SharedCast(Router):
    def forward(self, x):
        wide = x.float()
        return F.linear(wide, self.weight.float()), wide.sum(-1)


def test_a_narrowing_cast_or_one_read_elsewhere_keeps_its_own_region():
    narrowed = _regions(Narrowed(), (torch.randn(1, 32),))
    assert [k for k, _ in narrowed] == [RegionKind.POINTWISE, RegionKind.MATMUL]
    shared = _regions(SharedCast(), (torch.randn(1, 300).bfloat16(),))
    (product,) = [ops for k, ops in shared if k == RegionKind.MATMUL]
    assert product.count("aten._to_copy.default") == 1  # the weight's; x's is read twice
