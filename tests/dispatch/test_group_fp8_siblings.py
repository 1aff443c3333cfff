"""Grouping sibling fp8 decode GEMVs (kiln.dispatch.group_fp8_siblings): which plans
group or pair, which do not, and splitting them apart again. Plans only (fast); the
kernels' numerics are tests/codegen/test_grouped_fp8_gemv.py's."""

import torch
import torch.nn.functional as F

import kiln
from kiln.dispatch import split
from kiln.dispatch.group_siblings import products
from kiln.ir.plan import RegionKind
from kiln.ir.verify import verify_plan
from kiln.models.fp8 import Fp8Linear
from tests.dispatch.test_fold_rmsnorm import HFNorm

SM90 = "cuda:sm_90"


def fp8(k: int, n: int, seed: int, bias: bool = False) -> Fp8Linear:
    """A random [n, k] linear quantised to fp8 in 128 x 128 blocks."""
    torch.manual_seed(seed)
    return Fp8Linear.from_linear(torch.nn.Linear(k, n, bias=bias))


class LatentProjections(torch.nn.Module):
    """DeepSeek-V3's q_a_proj and kv_a_proj_with_mqa of one normed x: other widths,
    each product read by a region of its own."""

    def __init__(self, dim=256, q=192, kv=72, bias=False):
        super().__init__()
        self.norm = HFNorm(dim)
        self.q_a = fp8(dim, q, 0, bias)
        self.kv_a = fp8(dim, kv, 1, bias)

    def forward(self, x):
        h = self.norm(x)
        return self.q_a(h).float().pow(2), self.kv_a(h) * 2


class TwoLayers(torch.nn.Module):
    """Two layers' latent projections: siblings of two inputs (a family each)."""

    def __init__(self, dim=256):
        super().__init__()
        self.layers = torch.nn.ModuleList(LatentProjections(dim) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            h = layer.norm(x)
            x = x + layer.q_a(h)[..., :1] * layer.kv_a(h)[..., :1]
        return x


class Qkv(torch.nn.Module):
    """A Llama's q, k and v loaded with quantize="fp8": three siblings."""

    def __init__(self, dim=256, widths=(128, 64, 64), bias=False):
        super().__init__()
        self.norm = HFNorm(dim)
        self.projs = torch.nn.ModuleList(fp8(dim, n, 10 + i, bias)
                                         for i, n in enumerate(widths))

    def forward(self, x):
        h = self.norm(x)
        return tuple(p(h) for p in self.projs)


class GatedMLP(torch.nn.Module):
    """A dense / shared-expert MLP: SiLU(gate(h)) * up(h), then down."""

    def __init__(self, dim=256, ffn=160, bias=False):
        super().__init__()
        self.norm = HFNorm(dim)
        self.gate = fp8(dim, ffn, 2, bias)
        self.up = fp8(dim, ffn, 3, bias)
        self.down = fp8(ffn, dim, 4)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Unrelated(torch.nn.Module):
    """fp8 linears of different inputs (another K, another value): no siblings."""

    def __init__(self, dim=256):
        super().__init__()
        self.a, self.b, self.c = fp8(dim, 64, 5), fp8(128, 64, 6), fp8(dim, 64, 7)

    def forward(self, x):
        return self.a(x), self.b(x[..., :128]), self.c(x * 2)


class GateAlsoReturned(GatedMLP):
    """The gate's product also leaves the model: not paired, grouped side by side."""

    def forward(self, x):
        h = self.norm(x)
        g = self.gate(h)
        return self.down(F.silu(g) * self.up(h)), g


def plan_of(model, x, target=SM90, dynamic_shapes=None):
    plan = kiln.compile(model, (x,), target=target, compile_to="dispatch",
                        dynamic_shapes=dynamic_shapes)
    assert verify_plan(plan) == []
    return plan


def fp8_regions(plan):
    return [r for r in plan.regions if r.kind == RegionKind.EXTERN]


def test_independent_siblings_group_into_one_region_with_an_output_each():
    for model, n in ((LatentProjections(), 2), (Qkv(bias=True), 3)):
        plan = plan_of(model, torch.randn(1, 1, 256))
        (group,) = fp8_regions(plan)
        assert len(products(group)) == n and len(group.outputs) == n
        assert any(n.startswith("siblings: grouped") for n in group.notes)
    plan = plan_of(TwoLayers(), torch.randn(1, 1, 256))
    assert [len(products(r)) for r in fp8_regions(plan)] == [2, 2]


def test_gate_and_up_pair_into_the_pointwise_region():
    plan = plan_of(GatedMLP(bias=True), torch.randn(1, 1, 256))
    pair, down = fp8_regions(plan)
    assert len(products(pair)) == 2 and len(pair.outputs) == 1
    assert any(o.target == "aten.sigmoid.default" for o in pair.ops)
    assert not [r for r in plan.regions if r.kind == RegionKind.POINTWISE
                and any(o.target == "aten.sigmoid.default" for o in r.ops)]
    assert any("side by side in one GEMV" in n for n in pair.notes)
    assert len(products(down)) == 1


def test_non_siblings_prefill_and_the_cpu_target_stay_apart():
    plan = plan_of(Unrelated(), torch.randn(1, 1, 256))
    assert [len(products(r)) for r in fp8_regions(plan)] == [1, 1, 1]
    # more tokens than the fp8 GEMV form takes (a dynamic batch of up to 2 included)
    for x, dyn in ((torch.randn(1, 3, 256), None),
                   (torch.randn(2, 1, 256), ({0: torch.export.Dim("B", min=1, max=2)},))):
        plan = plan_of(GatedMLP(), x, dynamic_shapes=dyn)
        assert [len(products(r)) for r in fp8_regions(plan)] == [1, 1, 1]
    plan = plan_of(LatentProjections(), torch.randn(1, 1, 256), target="cpu")
    assert [len(products(r)) for r in fp8_regions(plan)] == [1, 1]


def test_a_product_read_elsewhere_is_not_paired():
    plan = plan_of(GateAlsoReturned(), torch.randn(1, 1, 256))
    group, down = fp8_regions(plan)
    assert len(products(group)) == 2 and len(group.outputs) == 2  # side by side
    # the SiLU product is not the pair's: the down projection computes it where it
    # reads x (dispatch/fold_fp8_prologue)
    assert not any(o.target == "aten.sigmoid.default" for o in group.ops)
    assert any(o.target == "aten.sigmoid.default" for o in down.ops)


def test_split_siblings_gives_back_each_product_and_the_pointwise_ops():
    for model, kinds in ((LatentProjections(), [RegionKind.EXTERN] * 2),
                         (GatedMLP(), [RegionKind.EXTERN] * 2 + [RegionKind.POINTWISE])):
        plan = plan_of(model, torch.randn(1, 1, 256), target="interpret")
        (group,) = [r for r in plan.regions if len(products(r)) > 1]
        parts = split.split_siblings(plan, group, "a test")
        assert verify_plan(plan) == []
        assert sorted(r.kind.value for r in parts) == sorted(k.value for k in kinds)
        assert all(len(products(r)) == (r.kind == RegionKind.EXTERN) for r in parts)
