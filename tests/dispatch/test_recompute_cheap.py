"""A small cheap value read by several regions is recomputed in each of them
(dispatch/recompute_cheap.py): its own launch goes, the result is eager's under the
interpreter; values some reader cannot recompute, large ones and views of a state
written in place stay apart."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.dispatch import recompute_cheap
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err


class TwoReaders(torch.nn.Module):
    """A cast of a slice, plus one, read by two reductions over different axes."""

    def forward(self, x):
        v = x[:, :6].float() + 1.0
        return v.sum(0), v.amax(1)


class TwoTopks(torch.nn.Module):
    """DeepSeek-V3's routing shape: scores plus a bias, picked from twice."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.randn(16))

    def forward(self, scores):
        choice = scores + self.bias
        groups = choice.view(-1, 4, 4).topk(2, dim=-1)[0]
        return groups, choice.topk(3, dim=-1)[1]


class ReadByAMatmul(TwoReaders):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 5))

    def forward(self, x):
        v = x[:, :6].float() + 1.0
        return v.sum(1), v @ self.w


class StateWritten(torch.nn.Module):
    """A view of a cache read before and after the cache's in-place write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 8))

    def forward(self, x, pos):
        v = self.cache + 1.0
        first = v.sum(1)
        self.cache.index_copy_(0, pos, x)
        return first, v.amax(0)


def _kinds(exe):
    return [r.kind for r in exe.plan.regions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cast_read_by_two_regions_is_recomputed_in_each(dtype):
    x = torch.randn(5, 9).to(dtype)
    exe = kiln.compile(TwoReaders(), (x,), target="interpret")
    assert _kinds(exe) == [RegionKind.REDUCTION, RegionKind.REDUCTION]
    assert all(any("cheap) recomputed here" in n for n in r.notes) for r in exe.plan.regions)
    for seed in (1, 2):
        x = torch.randn(5, 9, generator=torch.Generator().manual_seed(seed)).to(dtype)
        for got, want in zip(exe(x), TwoReaders()(x)):
            assert rel_err(got, want) <= 1e-6


def test_a_router_bias_is_recomputed_in_both_topks():
    scores, model = torch.rand(1, 16), TwoTopks()
    exe = kiln.compile(model, (scores,), target="interpret")
    assert _kinds(exe) == [RegionKind.TOPK, RegionKind.TOPK]
    got, want = exe(scores), model(scores)
    assert rel_err(got[0], want[0]) <= 1e-6 and torch.equal(got[1], want[1])


def test_values_a_reader_cannot_recompute_or_too_large_stay_apart(monkeypatch):
    x = torch.randn(5, 9)
    model = ReadByAMatmul()
    exe = kiln.compile(model, (x,), target="interpret")  # a matmul reads it
    assert RegionKind.POINTWISE in _kinds(exe)
    for got, want in zip(exe(x), model(x)):
        assert rel_err(got, want) <= 1e-6
    monkeypatch.setattr(recompute_cheap, "MAX_ELEMENTS", 8)  # 30 elements: too many
    exe = kiln.compile(TwoReaders(), (x,), target="interpret")
    assert RegionKind.POINTWISE in _kinds(exe)


def test_a_view_of_a_state_written_in_place_is_not_recomputed():
    model = StateWritten()
    x, pos = torch.randn(1, 8), torch.tensor([2])
    exe = kiln.compile(StateWritten(), (x, pos), target="interpret")
    assert not any(any("cheap) recomputed" in n for n in r.notes) for r in exe.plan.regions)
    got, want = exe(x, pos), model(x, pos)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6


def test_the_cpu_target_keeps_the_region():
    exe = kiln.compile(TwoReaders(), (torch.randn(5, 9),), target="cpu")
    assert RegionKind.POINTWISE in _kinds(exe)


class RotaryDecode(torch.nn.Module):
    """An HF-style decode step: the rotary tables read at the step's position and cast,
    read by the key cache write and by the attention's query."""

    def __init__(self, heads=2, dim=16, length=12):
        super().__init__()
        inv = 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)
        ang = torch.outer(torch.arange(length).float(), inv).repeat(1, 2)
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin())
        self.register_buffer("k_cache", torch.zeros(1, heads, length, dim))
        self.register_buffer("v_cache", torch.zeros(1, heads, length, dim))

    @staticmethod
    def rope(x, cos, sin):
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + turned * sin

    def forward(self, q, k, v, pos):
        cos, sin = self.cos[pos].to(q.dtype), self.sin[pos].to(q.dtype)  # [1, dim]
        self.k_cache.index_copy_(2, pos, self.rope(k, cos, sin).to(self.k_cache.dtype))
        self.v_cache.index_copy_(2, pos, v.to(self.v_cache.dtype))
        mask = (torch.arange(self.k_cache.shape[2]) <= pos)[None, :]
        return F.scaled_dot_product_attention(self.rope(q, cos, sin),
                                              self.k_cache.to(q.dtype),
                                              self.v_cache.to(q.dtype), attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_read_at_the_position_are_recomputed_in_decode_attention(dtype):
    """The gathered tables go into the cache write and the attention (one query): no
    kernel of their own, and the steps match eager's."""
    g = torch.Generator().manual_seed(0)
    step = [torch.randn(1, 2, 1, 16, generator=g).to(dtype) for _ in range(3)]
    exe = kiln.compile(RotaryDecode(), (*step, torch.tensor([0])), target="interpret")
    notes = [n for r in exe.plan.regions for n in r.notes if "cheap) recomputed" in n]
    attention = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert notes and any("cheap) recomputed" in n for n in attention[0].notes)
    model = RotaryDecode()
    for p in range(4):
        step = [torch.randn(1, 2, 1, 16, generator=g).to(dtype) for _ in range(3)]
        got, want = exe(*step, torch.tensor([p])), model(*step, torch.tensor([p]))
        assert rel_err(got, want) <= (1e-6 if dtype == torch.float32 else 1e-2)
