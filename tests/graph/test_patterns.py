import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.graph import GRAPH_PASSES
from kiln.graph.patterns import KEY
from kiln.ir.ops import op_name
from kiln.ir.printer import print_plan
from kiln.models.llama import LlamaConfig, apply_rope, tiny_llama
from kiln.models.llama import example_inputs as llama_inputs
from tests.graph.util import Dim, apply, graph_of


def labelled(module, *args, dynamic=None) -> dict[str, list[str]]:
    """Run the graph stage (patterns assume the passes before it); label -> op names."""
    kg = graph_of(module, *args, dynamic=dynamic)
    for p in GRAPH_PASSES:
        kg = apply(p, kg)
    out: dict[str, list[str]] = {}
    for n in kg.graph.nodes:
        if KEY in n.meta:
            out.setdefault(n.meta[KEY], []).append(op_name(n.target))
    return out


class RMSNorm(nn.Module):
    def __init__(self, dim, upcast, form):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim))
        self.upcast, self.form = upcast, form

    def forward(self, x):
        h = x.float() if self.upcast else x
        if self.form == "rsqrt":
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        else:
            h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


@pytest.mark.parametrize("shape,upcast,dtype,form", [
    ((7, 32), False, torch.float32, "rsqrt"),
    ((1, 5, 16), True, torch.bfloat16, "rsqrt"),
    ((2, 3, 5, 8), True, torch.float16, "div-sqrt"),
    ((1, 5, 16), False, torch.float32, "div-sqrt"),
])
def test_rmsnorm_any_rank_with_or_without_upcast(shape, upcast, dtype, form):
    m = RMSNorm(shape[-1], upcast, form).to(dtype)
    found = labelled(m, torch.randn(shape, dtype=dtype))
    assert set(found) == {"rmsnorm"}
    ops = found["rmsnorm"]
    assert "aten.mean.dim" in ops and ops.count("aten.mul.Tensor") >= 1
    if upcast:
        assert ops.count("aten._to_copy.default") == 2  # the upcast and the cast back


class LayerNormish(nn.Module):
    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-5)


def test_centred_norm_is_not_rmsnorm():
    assert labelled(LayerNormish(), torch.randn(4, 8)) == {}


class Rope(nn.Module):
    def __init__(self, style, upcast):
        super().__init__()
        self.style, self.upcast = style, upcast

    def forward(self, x, cos, sin):
        xf = x.float() if self.upcast else x
        if self.style == "chunk":
            x1, x2 = xf.chunk(2, dim=-1)
        else:
            half = xf.shape[-1] // 2
            x1, x2 = xf[..., :half], xf[..., half:]
        rot = torch.cat((-x2, x1), dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)


@pytest.mark.parametrize("style", ["chunk", "slice"])
@pytest.mark.parametrize("upcast", [False, True])
def test_rope_rotate_half(style, upcast):
    x, cos, sin = torch.randn(1, 4, 6, 16), torch.randn(6, 16), torch.randn(6, 16)
    T = Dim("T", min=1, max=64)
    found = labelled(Rope(style, upcast), x, cos, sin, dynamic=({2: T}, {0: T}, {0: T}))
    assert set(found) == {"rope"}
    assert sorted(found["rope"]).count("aten.slice.Tensor") == 2
    assert "aten.cat.default" in found["rope"] and "aten.neg.default" in found["rope"]


def test_llama_rope_helper_is_rope():
    class M(nn.Module):
        def forward(self, q, cos, sin):
            return apply_rope(q, cos, sin)

    found = labelled(M(), torch.randn(1, 2, 5, 8), torch.randn(5, 8), torch.randn(5, 8))
    assert set(found) == {"rope"}


class WrongRotation(nn.Module):
    def forward(self, x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((x2, -x1), dim=-1) * sin  # not rotate_half


def test_other_rotations_are_not_rope():
    args = torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 8)
    assert "rope" not in labelled(WrongRotation(), *args)


class MLP(nn.Module):
    def __init__(self, act, upcast=False):
        super().__init__()
        self.gate = nn.Linear(16, 24, bias=False)
        self.up = nn.Linear(16, 24, bias=False)
        self.down = nn.Linear(24, 16, bias=False)
        self.act, self.upcast = act, upcast

    def forward(self, x):
        g = self.gate(x)
        if self.act == "silu":
            a = F.silu(g.float()).to(x.dtype) if self.upcast else F.silu(g)
        elif self.act == "sigmoid":
            a = g * torch.sigmoid(g)
        else:
            a = F.gelu(g)
        return self.down(a * self.up(x))


@pytest.mark.parametrize("act,upcast", [("silu", False), ("silu", True), ("sigmoid", False)])
def test_swiglu_with_its_projections(act, upcast):
    found = labelled(MLP(act, upcast), torch.randn(1, 5, 16),
                     dynamic=({1: Dim("T", min=1)},))
    assert set(found) == {"swiglu"}
    assert found["swiglu"].count("aten.mm.default") == 2  # gate and up, not down


def test_geglu_is_not_swiglu():
    assert labelled(MLP("gelu"), torch.randn(3, 16)) == {}


class Attention(nn.Module):
    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, mask):
        if self.form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        if self.form == "written":  # SDPA's own order: graph/eager_attention rewrites it
            s = (q @ k.transpose(-1, -2)) / 4.0
            s = s.masked_fill(~mask, float("-inf"))
        else:  # a float mask added before the scaling: not SDPA's order, stays decomposed
            s = (q @ k.transpose(-1, -2) + torch.zeros_like(mask, dtype=q.dtype)
                 .masked_fill(~mask, -1e4)) / 4.0
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)  # HF's fp32 upcast
        return p @ v


@pytest.mark.parametrize("form,dtype", [("sdpa", torch.float32),
                                        ("written", torch.float32),
                                        ("decomposed", torch.float32),
                                        ("decomposed", torch.bfloat16)])
def test_attention(form, dtype):
    q, k, v = (torch.randn(1, h, 6, 16, dtype=dtype) for h in (4, 2, 2))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()
    T = Dim("T", min=2, max=32)
    found = labelled(Attention(form), q, k, v, mask,
                     dynamic=({2: T}, {2: T}, {2: T}, {0: T, 1: T}))
    assert set(found) == {"attention"}
    if form == "written":
        assert found["attention"] == ["aten.scaled_dot_product_attention.default"]
    if form == "decomposed":
        ops = found["attention"]
        assert ops.count("aten.bmm.default") == 2 and "aten._softmax.default" in ops
        if dtype != torch.float32:  # softmax in fp32 and the cast back are part of it
            assert ops.count("aten._to_copy.default") == 2


class Router(nn.Module):
    """A softmax over a matmul that no second matmul reads (MoE routing) is not attention."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return torch.softmax(self.w(x), dim=-1).topk(2, dim=-1).values


def test_router_softmax_is_not_attention():
    assert "attention" not in labelled(Router(), torch.randn(3, 16))


def test_tiny_llama_regions_carry_their_pattern():
    model = tiny_llama()
    args, dynamic = llama_inputs(model.cfg, seq_len=4)
    exe = kiln.compile(model, args, dynamic_shapes=dynamic)
    labels = [r.label for r in exe.plan.regions]
    layers = LlamaConfig(**{**model.cfg.__dict__}).n_layers
    assert labels.count("rmsnorm") == 2 * layers + 1
    assert labels.count("attention") == layers
    assert labels.count("swiglu") == 2 * layers  # the gate matmul and the up matmul + silu*mul
    text = print_plan(exe.plan)
    assert "pattern: rmsnorm" in text and "pattern: attention" in text
