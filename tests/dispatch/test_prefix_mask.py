"""Masks whose form passes each query row a prefix of the keys (dispatch/prefix_mask.py):
kiln.models' prompt mask over a cache, `arange(S) <= input_pos[b, i]`, in its forms.
Recognised, the envelope carries no count and the attention kernel no mask loops;
against eager under Triton's interpreter (prefill, a chunk, decode, a batch of two
position rows); masks that only look alike stay masks read tile by tile."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

T = torch.export.Dim("T", min=1, max=96)
S = 150

PREFIXES = {
    "kv <= pos": lambda kv, pos: kv <= pos,
    "kv < pos + 1": lambda kv, pos: kv < pos + 1,
    "pos >= kv": lambda kv, pos: pos >= kv,
    "kv - pos <= 0 and a row flag": lambda kv, pos: ((kv - pos) <= 0) & (pos >= 0),
}
NOT_PREFIXES = {
    "kv >= pos (a suffix)": lambda kv, pos: kv >= pos,
    "window": lambda kv, pos: (kv <= pos) & (kv > pos - 24),
    "2 kv <= pos": lambda kv, pos: kv * 2 <= pos,
    "kv <= pos and a key flag": lambda kv, pos: (kv <= pos) & (kv % 3 != 0),
}


class TwoLayers(torch.nn.Module):
    """Two attentions over a static cache reading one mask built from the positions."""

    def __init__(self, mask_of):
        super().__init__()
        self.mask_of = mask_of

    def forward(self, q, k_cache, v_cache, input_pos):
        kv = torch.arange(k_cache.shape[2], device=q.device)[None, None, None, :]
        mask = self.mask_of(kv, input_pos[:, None, :, None])
        x = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                           enable_gqa=True)
        return F.scaled_dot_product_attention(x * 0.5 + q, k_cache, v_cache, attn_mask=mask,
                                              enable_gqa=True)


def _compile(mask_of, **kw):
    args = (torch.randn(2, 4, 8, 16), torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16),
            torch.arange(8).expand(2, 8))
    return kiln.compile(TwoLayers(mask_of), args, dynamic_shapes=({2: T}, None, None, {1: T}),
                        target="interpret", **kw)


def _attentions(plan):
    return [r for r in plan.regions if r.kind == RegionKind.ATTENTION]


@pytest.mark.parametrize("name", list(PREFIXES))
def test_a_prefix_mask_is_plain_in_every_tile_and_matches_eager(name):
    exe = _compile(PREFIXES[name])
    attns = _attentions(exe.plan)
    assert len(attns) == 2 and all(r.key_bounds and r.key_bounds[2] is None for r in attns)
    assert attns[0].key_bounds == attns[1].key_bounds  # one envelope for the shared mask
    for r in attns:
        source = exe.program.kplan.kernels[r.name].spec.source
        assert "if not plain" not in source and "key_in" in source
    model = TwoLayers(PREFIXES[name])
    for start, t in ((0, 40), (37, 20), (140, 1)):  # prefill, a chunk, decode
        pos = torch.stack([torch.arange(start, start + t), torch.arange(t) * 3 % S])
        args = (torch.randn(2, 4, t, 16), torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16),
                pos)
        assert rel_err(exe(*args), model(*args)) <= 1e-5, (start, t)


@pytest.mark.parametrize("name", list(NOT_PREFIXES))
def test_a_mask_that_only_looks_alike_keeps_its_count(name):
    """Recognition at dispatch only (the plan): the mask loops stay for these."""
    attns = _attentions(_compile(NOT_PREFIXES[name], compile_to="dispatch"))
    assert attns and all(r.key_bounds and r.key_bounds[2] is not None for r in attns)


class PositionsOnTheKeys(torch.nn.Module):
    """Self-attention whose mask compares each key with the positions laid along the
    keys (`j <= 2 pos[j] + 1`, a [T, 1] column reshaped to [1, T]): not a prefix a row.
    (The graph stage moves the reshape before the arithmetic, so the plan never holds
    the column; prefix_mask.py also refuses a row value a reshape moves onto the keys.)"""

    def forward(self, q, k, v, pos):
        t = pos.shape[0]
        column = pos[:, None] * 2 + 1  # [T, 1]: constant along the keys, here
        mask = torch.arange(t)[None, :] <= column.reshape(1, t)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(t, t))


def test_positions_moved_onto_the_keys_are_no_prefix():
    args = (torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16),
            torch.arange(8))
    plan = kiln.compile(PositionsOnTheKeys(), args, target="interpret", compile_to="dispatch",
                        dynamic_shapes=({2: T}, {2: T}, {2: T}, {0: T}))
    attns = _attentions(plan)
    assert attns and all(r.key_bounds is None or r.key_bounds[2] is not None for r in attns)


def test_an_empty_row_in_a_prefix_mask_gives_what_eager_gives():
    """A row whose position is below 0 passes no key (a padding query)."""
    exe = _compile(PREFIXES["kv <= pos"])
    model = TwoLayers(PREFIXES["kv <= pos"])
    pos = torch.stack([torch.arange(-3, 17), torch.arange(20)])
    args = (torch.randn(2, 4, 20, 16), torch.randn(2, 2, S, 16), torch.randn(2, 2, S, 16), pos)
    got, ref = exe(*args), model(*args)
    live = pos[:, None, :, None].expand_as(ref) >= 0
    assert rel_err(got[live], ref[live]) <= 1e-5
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref)) or not got[~live].any()
