"""Per-region bytes moved and flops, as symbolic expressions in the plan's size symbols."""

import sympy
import torch
import torch.nn.functional as F

import kiln
from kiln.dispatch.cost import plan_costs, region_cost
from kiln.ir.plan import RegionKind
from kiln.ir.symbolic import evaluate


def _plan(model, args, dims):
    return kiln.compile(model, args, dynamic_shapes=dims, compile_to="dispatch")


def _sym(plan):
    (name,) = plan.symbols
    return sympy.Symbol(name, integer=True, positive=True)


def _eq(expr, expected) -> bool:
    return sympy.expand(sympy.sympify(expr) - expected) == 0


def _only(plan, kind):
    (r,) = [r for r in plan.regions if r.kind == kind]
    return r


class MatMul(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 24))

    def forward(self, x):
        return x @ self.w


def test_matmul_is_2mnk_and_reads_the_weight_once():
    plan = _plan(MatMul(), (torch.randn(5, 16),), ({0: kiln.Dim("M", min=1, max=64)},))
    m = _sym(plan)
    c = region_cost(_only(plan, RegionKind.MATMUL), plan)
    assert _eq(c.flops, 2 * m * 24 * 16)
    assert _eq(c.read, (m * 16 + 16 * 24) * 4)
    assert _eq(c.written, m * 24 * 4)


class Attn(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=False)


def test_attention_is_4_b_h_tq_tk_d():
    T = kiln.Dim("T", min=1, max=128)
    q, k, v = (torch.randn(2, 3, 7, 16) for _ in range(3))
    plan = _plan(Attn(), (q, k, v), ({2: T}, {2: T}, {2: T}))
    t = _sym(plan)
    c = region_cost(_only(plan, RegionKind.ATTENTION), plan)
    assert _eq(c.flops, 4 * 2 * 3 * t * t * 16)
    assert _eq(c.bytes, 4 * (2 * 3 * t * 16) * 4)  # q, k, v read; out written


class Chain(torch.nn.Module):
    def forward(self, x, b):
        return torch.relu(x * 2.0 + b)


def test_pointwise_counts_ops_and_reads_broadcast_inputs_at_their_size():
    plan = _plan(Chain(), (torch.randn(5, 8), torch.randn(8)),
                 ({0: kiln.Dim("T", min=1)}, None))
    t = _sym(plan)
    c = region_cost(_only(plan, RegionKind.POINTWISE), plan)
    assert _eq(c.flops, 3 * 8 * t)
    assert _eq(c.read, 8 * t * 4 + 8 * 4)  # b is read at its own 8 elements
    assert _eq(c.written, 8 * t * 4)


class RowSum(torch.nn.Module):
    def forward(self, x):
        return x.sum(-1)


def test_reduction_is_one_op_per_input_element():
    plan = _plan(RowSum(), (torch.randn(5, 8),), ({0: kiln.Dim("T", min=1, max=9)},))
    t = _sym(plan)
    c = region_cost(_only(plan, RegionKind.REDUCTION), plan)
    assert _eq(c.flops, 8 * t)
    assert _eq(c.bytes, 8 * t * 4 + t * 4)


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(1000, 16)

    def forward(self, idx):
        return self.table(idx)


def test_gather_reads_only_the_gathered_rows():
    plan = _plan(Embed(), (torch.arange(6),), ({0: kiln.Dim("T", min=1, max=512)},))
    t = _sym(plan)
    (c,) = plan_costs(plan).values()
    assert _eq(c.read, t * 16 * 4 + t * 8)  # rows + int64 indices, not 1000 x 16
    assert _eq(c.written, t * 16 * 4)
    assert c.flops == 0


class Cache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(64, 8))

    def forward(self, pos, x):
        self.cache.index_copy_(0, pos, x)
        return self.cache.sum()


def test_in_place_scatter_writes_only_what_it_scatters():
    T = kiln.Dim("T", min=1, max=64)
    exe = kiln.compile(Cache(), (torch.arange(3), torch.randn(3, 8)),
                       dynamic_shapes=({0: T}, {0: T}))
    plan = exe.plan
    t = _sym(plan)
    (r,) = [r for r in plan.regions if r.inplace]
    c = region_cost(r, plan)
    assert _eq(c.read, t * 8 + t * 8 * 4)  # the index and the rows, not the 64x8 cache
    assert _eq(c.written, t * 8 * 4)
    assert evaluate(c.bytes, {str(t): 2}) < 64 * 8 * 4


def _extern_flops(model, args, dims=None):
    plan = _plan(model, args, None if dims is None else (dims,))  # forward(*args)
    (r,) = [r for r in plan.regions if any(op.target.startswith("kiln.") for op in r.ops)]
    return region_cost(r, plan).flops, plan


class _Op(torch.nn.Module):
    def __init__(self, fn, *weights):
        super().__init__()
        self.fn = fn
        self.w = torch.nn.ParameterList([torch.nn.Parameter(w, requires_grad=False)
                                         for w in weights])

    def forward(self, *args):
        return self.fn(*args, *self.w)


def test_kiln_ops_count_what_they_compute():
    """Flops of kiln's own ops (extern regions report 0 for unknown ops): the routed
    experts 6·N·k·I·D, latent attention 2·B·T·H·S·(2R + P) over the cache's reach (a
    paged one's table x block), the gated delta rule 6·B·T·HV·K·V, fp8 linear 2·M·N·K,
    symbolic in the token count."""
    from kiln.ops import (
        fp8_linear,
        gated_delta_rule,
        latent_attention,
        moe_experts,
        moe_experts_fp8,
        quantize_experts,
    )
    from kiln.ops.fp8_linear import quantize_weight

    T = kiln.Dim("tokens", min=1, max=64)
    E, W, D, k = 6, 5, 16, 3  # experts, expert width, dim, experts per token
    moe = _Op(moe_experts, torch.randn(E, W, D), torch.randn(E, W, D), torch.randn(E, D, W))
    args = (torch.randn(7, D), torch.rand(7, k), torch.randint(0, E, (7, k)))
    flops, plan = _extern_flops(moe, args, ({0: T},) * 3)
    assert _eq(flops, 6 * _sym(plan) * k * W * D)
    fp8_weights = [t for w in moe.w for t in quantize_experts(w.data)]
    moe8 = _Op(moe_experts_fp8, *fp8_weights)  # the fp8 form counts the same products
    flops, plan = _extern_flops(moe8, args, ({0: T},) * 3)
    assert _eq(flops, 6 * _sym(plan) * k * W * D)

    B, H, R, P, blocks, block = 2, 4, 32, 8, 3, 4
    table = torch.arange(B * blocks).view(B, blocks)
    pool = torch.randn(B * blocks, block, R + P)
    mla = _Op(lambda q, qr, pool, pos, table: latent_attention(
        q, qr, pool[..., :R], pool[..., R:], pos, 0.1, table))
    args = (torch.randn(B, 1, H, R), torch.randn(B, 1, H, P), pool,
            torch.tensor([[5], [9]]), table)
    flops, _ = _extern_flops(mla, args)
    assert flops == 2 * B * H * blocks * block * (2 * R + P)

    HV, K, V = 4, 8, 8
    q, kk = torch.randn(1, 7, 2, K), torch.randn(1, 7, 2, K)
    delta = _Op(lambda q, k, v, g, b: gated_delta_rule(q, k, v, g, b)[0])
    args = (q, kk, torch.randn(1, 7, HV, V), -torch.rand(1, 7, HV), torch.rand(1, 7, HV))
    flops, plan = _extern_flops(delta, args, ({1: T},) * 5)
    assert _eq(flops, 6 * _sym(plan) * HV * K * V)

    wq, ws = quantize_weight(torch.randn(40, 300))
    fp8 = _Op(lambda x, w, s: fp8_linear(x, w, s, None), wq, ws)
    flops, plan = _extern_flops(fp8, (torch.randn(5, 300),), ({0: T},))
    assert _eq(flops, 2 * _sym(plan) * 40 * 300)
