"""Attention written out becomes one SDPA op (kiln.graph.eager_attention): which chains
are rewritten, which stay, and the compiled module against eager on the interpret
target (kiln's attention kernel; fp32 1e-5, fp16 1e-2) and the CPU target."""

import math

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
SDPA = "aten.scaled_dot_product_attention.default"
SOFTCAP = "kiln.softcap_attention.default"


class NanoGPTAttention(torch.nn.Module):
    """nanoGPT's CausalSelfAttention, slow path: a tril buffer, masked_fill(-inf)."""

    def __init__(self, dim=64, heads=4, block=16):
        super().__init__()
        self.c_attn, self.c_proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.heads = heads
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class HFEagerAttention(torch.nn.Module):
    """transformers' eager_attention_forward: repeat_kv (GQA), an additive causal mask
    of finfo.min, the softmax in fp32 cast back. `weights`: also returns the
    probabilities (output_attentions), which keeps the chain as written."""

    def __init__(self, dim=64, heads=4, kv=2, weights=False):
        super().__init__()
        self.hd, self.heads, self.kv, self.weights = dim // heads, heads, kv, weights
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, kv * self.hd)
        self.v = torch.nn.Linear(dim, kv * self.hd)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k, v = (p(x).view(B, T, self.kv, self.hd).transpose(1, 2) for p in (self.k, self.v))
        rep = self.heads // self.kv
        k, v = (t[:, :, None].expand(B, self.kv, rep, T, self.hd).reshape(B, self.heads, T,
                                                                          self.hd)
                for t in (k, v))
        mask = torch.full((T, T), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        w = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5 + mask[None, None]
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w, v).transpose(1, 2).reshape(B, T, -1)
        return (out, w) if self.weights else out


class GPT2Attention(torch.nn.Module):
    """transformers' GPT-2 eager path: divide by a full([]) tensor, then
    where(causal, w, finfo.min)."""

    def __init__(self, dim=64, heads=4, block=16):
        super().__init__()
        self.hd, self.heads = dim // heads, heads
        self.c_attn = torch.nn.Linear(dim, 3 * dim)
        self.register_buffer("causal", torch.tril(torch.ones(block, block, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, self.hd).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w / torch.full([], self.hd ** 0.5, dtype=w.dtype)
        w = torch.where(self.causal[:T, :T], w, torch.finfo(w.dtype).min)
        return torch.matmul(F.softmax(w, dim=-1), v)


class OneHead(torch.nn.Module):
    """3-d attention, no mask, the scale on the scores by division."""

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(1, 2) / 4.0, dim=-1) @ v


class Unfit(torch.nn.Module):
    """Chains neither SDPA nor the softcap op computes: an additive mask before the
    scaling, a mask under the softcap's tanh."""

    def __init__(self, form):
        super().__init__()
        self.form = form

    def forward(self, q, k, v, m):
        s = q @ k.transpose(-2, -1)
        if self.form == "added_then_scaled":
            s = (s + m) * 0.25
        else:
            s = torch.tanh((s + m) / 30.0) * 30.0
        return torch.softmax(s, dim=-1) @ v


def _sdpa_count(model, args, op=SDPA, **kw):
    kg = kiln.compile(model, args, target="interpret", compile_to="graph", **kw)
    return sum(n.op == "call_function" and str(n.target) == op for n in kg.graph.nodes)


def _check(model, exe, cases, dtype):
    with torch.no_grad():
        for args in cases:
            got, ref = exe(*args), model(*args)
            got, ref = (got[0], ref[0]) if isinstance(got, tuple) else (got, ref)
            assert rel_err(got, ref) <= TOL[dtype], rel_err(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nanogpt_prompt_of_any_length_runs_one_attention_kernel(dtype):
    model = NanoGPTAttention().to(dtype).eval()
    t = torch.export.Dim("T", min=2, max=15)
    exe = kiln.compile(model, (torch.randn(1, 8, 64, dtype=dtype),), target="interpret",
                       dynamic_shapes=({1: t},))
    kinds = [r.kind for r in exe.plan.regions]
    assert kinds.count(RegionKind.ATTENTION) == 1 and RegionKind.MATMUL in kinds
    assert len([k for k in kinds if k == RegionKind.MATMUL]) == 2  # c_attn, c_proj only
    _check(model, exe, [(torch.randn(1, n, 64, dtype=dtype),) for n in (2, 9, 15)], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_transformers_eager_attention_with_repeated_kv_heads(dtype):
    model = HFEagerAttention().to(dtype).eval()
    x = torch.randn(1, 6, 64, dtype=dtype)
    assert _sdpa_count(model, (x,)) == 1
    exe = kiln.compile(model, (x,), target="interpret")
    _check(model, exe, [(x,), (3 * torch.randn(1, 6, 64, dtype=dtype),)], dtype)


def test_gpt2_fill_of_finfo_min_after_the_scaling():
    model = GPT2Attention().eval()
    x = torch.randn(1, 7, 64)
    assert _sdpa_count(model, (x,)) == 1
    _check(model, kiln.compile(model, (x,), target="interpret"), [(x,)], torch.float32)
    _check(model, kiln.compile(model, (x,), target="cpu"), [(x,)], torch.float32)


def test_one_head_in_three_dims():
    args = tuple(torch.randn(3, 5, 16) for _ in range(3))
    assert _sdpa_count(OneHead(), args) == 1
    _check(OneHead(), kiln.compile(OneHead(), args, target="interpret"), [args],
           torch.float32)


class Cross(torch.nn.Module):
    """Cross attention: keys longer than the queries, a value width of its own, a
    boolean mask per batch."""

    def forward(self, q, k, v, m):
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.matmul(torch.softmax(s.masked_fill(~m, float("-inf")), -1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cross_attention_with_its_own_value_width(dtype):
    q, k, v = (torch.randn(2, 3, n, d, dtype=dtype) for n, d in ((5, 16), (9, 16), (9, 8)))
    m = torch.rand(2, 1, 5, 9) > 0.3
    m[..., 0] = True
    args = (q, k, v, m)
    assert _sdpa_count(Cross(), args) == 1
    _check(Cross(), kiln.compile(Cross(), args, target="interpret"), [args], dtype)


def test_returned_weights_and_unfit_chains_stay_as_written():
    x = torch.randn(1, 6, 64)
    assert _sdpa_count(HFEagerAttention(weights=True).eval(), (x,)) == 0
    args = (*(torch.randn(2, 4, 5, 16) for _ in range(3)), torch.randn(5, 5))
    for form in ("added_then_scaled", "masked_under_the_cap"):
        model = Unfit(form)
        assert _sdpa_count(model, args) == _sdpa_count(model, args, SOFTCAP) == 0
        _check(model, kiln.compile(model, args, target="interpret"), [args], torch.float32)
