"""Complex products as real arithmetic (graph/complex_products.py): Meta's RoPE, a complex
multiply over a complex64 table, compiles to generated kernels and matches eager."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln
from kiln.graph.complex_products import real_products
from tests.graph.util import assert_same_as_eager, graph_of, ops
from tests.helpers import rel_err

S, H, D = 16, 2, 8


def _angles():
    freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))
    return torch.outer(torch.arange(S).float(), freqs)


class MetaRope(nn.Module):
    """Meta's apply_rotary_emb on q and k, then SDPA over a static KV cache. `table`:
    "buffer" (torchtitan's complex64 buffer), "attribute" (Meta's plain attribute,
    lifted as a constant) or "polar" (made in forward from an angle buffer)."""

    def __init__(self, table: str):
        super().__init__()
        self.table = table
        self.wqkv = nn.Linear(H * D, 3 * H * D, bias=False)
        cis = torch.polar(torch.ones(S, D // 2), _angles())
        if table == "buffer":
            self.register_buffer("freqs_cis", cis, persistent=False)
        elif table == "attribute":
            self.freqs_cis = cis
        else:
            self.register_buffer("angles", _angles(), persistent=False)
        self.register_buffer("k_cache", torch.zeros(1, H, S, D), persistent=False)
        self.register_buffer("v_cache", torch.zeros(1, H, S, D), persistent=False)
        self.register_buffer("causal", torch.tril(torch.ones(S, S, dtype=torch.bool)))

    def forward(self, x, pos):
        B, T, _ = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, H, D).unbind(2)
        cis = torch.polar(torch.ones_like(self.angles), self.angles) \
            if self.table == "polar" else self.freqs_cis
        cis = cis[pos].view(1, T, 1, D // 2)
        q, k = (torch.view_as_real(torch.view_as_complex(t.float().reshape(B, T, H, -1, 2))
                                   * cis).flatten(3).type_as(t) for t in (q, k))
        self.k_cache.index_copy_(2, pos, k.transpose(1, 2))
        self.v_cache.index_copy_(2, pos, v.transpose(1, 2))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), self.k_cache, self.v_cache,
                                           attn_mask=self.causal[pos][None, None])
        return y.transpose(1, 2).reshape(B, T, H * D)


@pytest.mark.parametrize("table", ["buffer", "attribute", "polar"])
def test_meta_rope_runs_generated_kernels_and_matches_eager(table):
    """Every complex op ran as PyTorch's own, and so did the attention and cache writes
    that took the rotated q and k: 'extern: Triton has no complex dtypes'."""
    torch.manual_seed(0)
    model = MetaRope(table).eval()
    eager = copy.deepcopy(model)
    seq = kiln.Dim("seq", min=2, max=S)
    exe = kiln.compile(model, (torch.randn(1, 4, H * D), torch.arange(4)),
                       dynamic_shapes=({1: seq}, {0: seq}), target="interpret")
    kinds = {k.kind for k in exe.program.kplan.kernels.values()}
    assert kinds == {"triton"}, exe.explain()
    for x, pos in ((torch.randn(1, 6, H * D), torch.arange(6)),
                   (torch.randn(1, 3, H * D), torch.arange(6, 9))):
        assert rel_err(exe(x, pos), eager(x, pos)) < 1e-5
    assert rel_err(model.k_cache, eager.k_cache) < 1e-5


class Untouched(nn.Module):
    """A complex table the model writes: its pairs would go stale, so it stays complex."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cis", torch.polar(torch.ones(S, D // 2), _angles()))

    def forward(self, x, pos):
        self.cis.mul_(1.0)
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.cis[pos]).flatten(-2)


def test_a_table_the_model_writes_is_left_complex():
    model = Untouched()
    x, pos = torch.randn(3, D), torch.tensor([1, 5, 7])
    kg = graph_of(model, x, pos)
    assert real_products(kg) == 0 and "aten.view_as_complex.default" in ops(kg)
    assert_same_as_eager(kg, model, (x, pos))


@pytest.mark.parametrize("table", ["buffer", "attribute"])
def test_the_tables_pairs_are_recorded_as_derived_from_it(table):
    """The compile cache keeps this recipe instead of the pairs, and replays it at a hit."""
    model = MetaRope(table).eval()
    x, pos = torch.randn(1, 4, H * D), torch.arange(4)
    kg = graph_of(model, x, pos)
    assert real_products(kg) == 2
    (name, d), = kg.derived.items()
    assert d.source == "freqs_cis" and d.steps == ("view_as_real",)
    assert torch.equal(kg.state[name], torch.view_as_real(model.freqs_cis))
    assert "freqs_cis" in kg.state  # the model's table stays its state, to replay from
    assert_same_as_eager(kg, model, (x, pos))


def test_a_table_built_in_forward_records_nothing():
    kg = graph_of(MetaRope("polar").eval(), torch.randn(1, 4, H * D), torch.arange(4))
    assert real_products(kg) == 2 and not kg.derived
