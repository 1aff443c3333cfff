"""Small graphs compiled for the CPU match eager PyTorch at 1e-5 (fp32)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

from tests.helpers import compile_and_compare


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x))).relu() * 0.5


def test_mlp_dynamic_batch():
    B = Dim("B", min=1, max=64)
    compile_and_compare(MLP(), (torch.randn(4, 16),), dynamic_shapes=({0: B},),
                        calls=[(torch.randn(1, 16),), (torch.randn(37, 16),)])


class AttentionBlock(nn.Module):
    """Pre-norm GQA self-attention with a causal mask and a residual."""

    def __init__(self, dim=32, heads=4, kv_heads=2, mask="causal"):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, dim // heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, heads * self.d, bias=False)
        self.kvp = nn.Linear(dim, 2 * kv_heads * self.d, bias=True)
        self.o = nn.Linear(heads * self.d, dim, bias=False)
        self.mask = mask

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, T, self.h, self.d).transpose(1, 2)
        k, v = self.kvp(h).view(B, T, 2 * self.kv, self.d).transpose(1, 2).chunk(2, dim=1)
        if self.mask == "causal":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            pos = torch.arange(T, device=x.device)
            allowed = pos[None, :] <= pos[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        return x + self.o(y.transpose(1, 2).reshape(B, T, self.h * self.d))


@pytest.mark.parametrize("mask", ["causal", "explicit"])
def test_attention_block_gqa_causal(mask):
    T = Dim("T", min=2, max=64)
    compile_and_compare(AttentionBlock(mask=mask), (torch.randn(2, 8, 32),),
                        dynamic_shapes=({1: T},),
                        calls=[(torch.randn(2, 3, 32),), (torch.randn(2, 33, 32),)])


REDUCTIONS = {
    "sum": lambda x, d, k: x.sum(d, keepdim=k),
    "mean": lambda x, d, k: x.mean(d, keepdim=k),
    "amax": lambda x, d, k: x.amax(d, keepdim=k),
    "amin": lambda x, d, k: x.amin(d, keepdim=k),
    "var": lambda x, d, k: x.var(d, keepdim=k),
}


class Reductions(nn.Module):
    """One op over every axis, pairs of axes and all axes, keepdim True and False."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def forward(self, x):
        r = REDUCTIONS[self.name]
        outs = []
        for keep in (True, False):
            for d in (0, 1, 2, -1, (0, 2), (1, 2), (0, 1, 2)):
                outs.append(r(x, d, keep))
        return tuple(outs)


@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reductions_every_axis(name):
    T = Dim("T", min=2, max=32)
    compile_and_compare(Reductions(name), (torch.randn(3, 5, 7),), dynamic_shapes=({1: T},),
                        calls=[(torch.randn(3, 9, 7),)])


class FullReductions(nn.Module):
    def forward(self, x):
        total = x.sum() / x.numel()
        return x.sum(), x.mean(), x.amax(), x.amin(), x.var(), (x * x).sum().sqrt(), total


class Softmaxes(nn.Module):
    def forward(self, x):
        outs = []
        for d in (0, 1, 2, -1):
            outs += [torch.softmax(x, d), torch.log_softmax(x, d)]
        return tuple(outs)


@pytest.mark.parametrize("module", [FullReductions(), Softmaxes()])
def test_full_reductions_and_softmax(module):
    T = Dim("T", min=2, max=32)
    compile_and_compare(module, (torch.randn(3, 5, 7),), dynamic_shapes=({1: T},),
                        calls=[(torch.randn(3, 11, 7),)])


class Broadcasts(nn.Module):
    def forward(self, x, row, col, s):
        a = x + row  # [B, T, D] + [D]
        b = x * col  # [B, T, D] * [T, 1]
        c = torch.where(x > 0, a, s)  # 0-d tensor
        d = (row[None, None, :] - col[None]) / (1.0 + s)  # [1,1,D] - [1,T,1] -> [1,T,D]
        return a, b, c, d + x.mean(0, keepdim=True), torch.maximum(x, row.expand_as(x))


def test_broadcasts():
    T = Dim("T", min=2, max=64)
    args = (torch.randn(2, 6, 8), torch.randn(8), torch.randn(6, 1), torch.tensor(0.25))
    later = (torch.randn(2, 13, 8), torch.randn(8), torch.randn(13, 1), torch.tensor(-1.5))
    compile_and_compare(Broadcasts(), args, dynamic_shapes=({1: T}, None, {0: T}, None),
                        calls=[later])


class Views(nn.Module):
    def forward(self, x):
        B, T, D = x.shape
        p = x.permute(2, 0, 1) * 2  # [D, B, T]
        sl = x[:, 1:, ::2] + 1  # slice with a step
        sel = x[:, 0].unsqueeze(1) - x.select(2, 3).unsqueeze(-1)  # select, unsqueeze
        ex = x[:, :1].expand(B, T, D) * x
        sq = x.sum(-1, keepdim=True).squeeze(-1)
        cat = torch.cat([x, -x[..., :2]], dim=-1)
        a, b = x.chunk(2, dim=-1)
        c, d, e = x.split([2, 3, 3], dim=-1)
        nc = x.transpose(1, 2).reshape(B, D * T)  # reshape of a non-contiguous view
        flat = x.reshape(-1, 4).t().contiguous().view(4, B * T * 2)
        return p, sl, sel, ex, sq, cat, a * b, c.sum(-1) + d.mean(-1) - e.amax(-1), nc, flat


def test_views():
    T = Dim("T", min=3, max=64)
    compile_and_compare(Views(), (torch.randn(2, 5, 8),), dynamic_shapes=({1: T},),
                        calls=[(torch.randn(2, 12, 8),), (torch.randn(2, 3, 8),)])


class Unbounded(nn.Module):
    """Every graph pass meets a dim with no upper bound: they must fall back, not fail."""

    def forward(self, x, w):
        h = x.view(x.shape[0], 2, 4).permute(1, 0, 2)
        h = torch.softmax(h.permute(1, 0, 2).reshape(x.shape[0], 8) * w.t().float(), dim=-1)
        a, b = h.chunk(2, dim=-1)
        return torch.cat((-b, a), dim=-1) + x.clone() * 1


def test_unbounded_dim_through_the_graph_stage():
    T = Dim("T", min=1)
    w = torch.randn(8, 1, dtype=torch.float64)
    compile_and_compare(Unbounded(), (torch.randn(5, 8), w), dynamic_shapes=({0: T}, None),
                        calls=[(torch.randn(1, 8), w), (torch.randn(300, 8), w)])


class _Norms(torch.nn.Module):
    def forward(self, x):
        return x.norm(dim=-1, keepdim=True), x.norm(), torch.linalg.vector_norm(x, 3, dim=(0, 2))


def test_vector_norms_match_eager():
    from tests.helpers import compile_and_compare

    x = torch.randn(3, 5, 7)
    compile_and_compare(_Norms(), (x,), calls=((torch.randn(3, 5, 7),),))


class _ReturnsTwice(torch.nn.Module):
    def forward(self, x):
        y = torch.softmax(x, -1)
        return y, torch.softmax(x.float(), -1).to(x.dtype), x, x


def test_value_returned_twice_is_computed_once():
    import kiln
    from kiln.ir.plan import RegionKind

    x = torch.randn(4, 9)
    exe = kiln.compile(_ReturnsTwice(), (x,))
    assert sum(r.kind == RegionKind.REDUCTION for r in exe.plan.regions) == 1
    out = exe(x)
    torch.testing.assert_close(out[0], torch.softmax(x, -1))
    torch.testing.assert_close(out[1], out[0])
    assert torch.equal(out[2], x) and torch.equal(out[3], x)
