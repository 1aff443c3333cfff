"""Grouping sibling decode GEMVs (kiln.dispatch.group_siblings): which plans group, which
do not, and splitting a group apart again. Plans only (fast); the kernels' numerics are
tests/codegen/test_grouped_gemv.py's."""

import torch
import torch.nn.functional as F

import kiln
from kiln.dispatch import split
from kiln.ir.ops import OpCategory, category
from kiln.ir.plan import RegionKind
from kiln.ir.verify import verify_plan
from tests.dispatch.test_fold_rmsnorm import HFNorm

SM90 = "cuda:sm_90"


class Attention(torch.nn.Module):
    """HF Llama's decode attention block: q, k, v of one normed x (bias: Qwen2's)."""

    def __init__(self, dim=64, heads=4, kv_heads=2, bias=False):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.norm = HFNorm(dim)
        self.q_proj = torch.nn.Linear(dim, heads * self.hd, bias=bias)
        self.k_proj = torch.nn.Linear(dim, kv_heads * self.hd, bias=bias)
        self.v_proj = torch.nn.Linear(dim, kv_heads * self.hd, bias=bias)
        self.o_proj = torch.nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v)
        return x + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(torch.nn.Module):
    """HF Llama's MLP: separate gate and up projections of one normed x."""

    def __init__(self, dim=64, ffn=96):
        super().__init__()
        self.norm = HFNorm(dim)
        self.gate_proj = torch.nn.Linear(dim, ffn, bias=False)
        self.up_proj = torch.nn.Linear(dim, ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class GateAlsoReturned(MLP):
    """The gate's product also leaves the model: it cannot be absorbed into up's."""

    def forward(self, x):
        h = self.norm(x)
        g = self.gate_proj(h)
        return self.down_proj(F.silu(g) * self.up_proj(h)), g


class Unrelated(torch.nn.Module):
    """Products of different inputs (another K, another normed value): no siblings."""

    def __init__(self, dim=64):
        super().__init__()
        self.a = torch.nn.Linear(dim, 32, bias=False)
        self.b = torch.nn.Linear(dim // 2, 32, bias=False)
        self.c = torch.nn.Linear(dim, 32, bias=False)

    def forward(self, x):
        return self.a(x), self.b(x[..., :32]), self.c(x * 2)


class TwoInputs(torch.nn.Module):
    """Products of two 2-d inputs read as they are (no op computes the left operand):
    the same K, not siblings. Grouped, the second read the first's input."""

    def __init__(self, dim=64):
        super().__init__()
        self.a = torch.nn.Linear(dim, 32, bias=False)
        self.b = torch.nn.Linear(dim, 48, bias=False)

    def forward(self, x, y):
        return self.a(x), self.b(y)


class RawWeights(torch.nn.Module):
    """x @ W with [K, N_i] weights: grouped here, but their index maps differ (k * N_i +
    n), so the grouped GEMV declines and the siblings are split apart again."""

    def __init__(self, dim=64):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(dim, 48) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(dim, 32) / 8)

    def forward(self, x):
        return x @ self.w1, x @ self.w2


def plan_of(model, args, target=SM90, dynamic_shapes=None):
    plan = kiln.compile(model, args, target=target, compile_to="dispatch",
                        dynamic_shapes=dynamic_shapes)
    assert verify_plan(plan) == []
    return plan


def products(region):
    return [o.name for o in region.ops if category(o.target) == OpCategory.MATMUL]


def matmuls(plan):
    return [r for r in plan.regions if r.kind == RegionKind.MATMUL]


def test_q_k_v_group_into_one_region_with_three_outputs():
    for bias in (False, True):
        plan = plan_of(Attention(bias=bias), (torch.randn(1, 1, 64),))
        qkv, o_proj = matmuls(plan)
        assert len(products(qkv)) == 3 and len(qkv.outputs) == 3
        assert [category(o.target) for o in qkv.ops].count(OpCategory.REDUCTION) == 1
        assert any(n.startswith("siblings: grouped") for n in qkv.notes)
        assert len(products(o_proj)) == 1


def test_gate_and_up_pair_into_one_region_one_output():
    plan = plan_of(MLP(), (torch.randn(1, 1, 64),))
    gate_up, down = matmuls(plan)
    assert len(products(gate_up)) == 2 and len(gate_up.outputs) == 1
    assert len(plan.regions) == 2
    assert any("read only by this epilogue" in n for n in gate_up.notes)


def test_dynamic_decode_batch_groups_and_prefill_does_not():
    b = torch.export.Dim("B", min=1, max=4)
    plan = plan_of(Attention(), (torch.randn(2, 1, 64),), dynamic_shapes=({0: b},))
    assert len(products(matmuls(plan)[0])) == 3
    t = torch.export.Dim("T", min=2, max=64)
    prefill = plan_of(Attention(), (torch.randn(1, 16, 64),), dynamic_shapes=({1: t},))
    assert all(len(products(r)) == 1 for r in matmuls(prefill))


def test_the_cpu_target_does_not_group():
    plan = plan_of(Attention(), (torch.randn(1, 1, 64),), target="cpu")
    assert all(len(products(r)) == 1 for r in matmuls(plan))


def test_a_product_read_elsewhere_is_not_absorbed():
    plan = plan_of(GateAlsoReturned(), (torch.randn(1, 1, 64),))
    assert all(len(products(r)) == 1 for r in matmuls(plan)) and len(matmuls(plan)) == 3


def test_products_of_different_inputs_do_not_group():
    plan = plan_of(Unrelated(), (torch.randn(1, 1, 64),))
    assert all(len(products(r)) == 1 for r in matmuls(plan)) and len(matmuls(plan)) == 3
    plan = plan_of(TwoInputs(), (torch.randn(1, 64), torch.randn(1, 64)))
    assert [len(products(r)) for r in matmuls(plan)] == [1, 1]


def test_split_siblings_restores_one_region_a_product():
    for model in (Attention(), MLP()):
        plan = plan_of(model, (torch.randn(1, 1, 64),), target="interpret")
        (group,) = [r for r in matmuls(plan) if len(products(r)) > 1]
        n = len(products(group))
        parts = split.split_siblings(plan, group, "a test")
        assert verify_plan(plan) == [] and len(parts) == n
        assert all(len(products(r)) == 1 for r in parts)
        assert all("siblings apart: a test" in r.notes for r in parts)
