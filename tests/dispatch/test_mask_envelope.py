"""dispatch/mask_envelope.py: which attention regions get an envelope, that regions
reading one mask share one, and that its kernel computes each row's first live key and
one past its last (fully masked rows included). Outputs against eager are in
tests/codegen/test_attention_envelope.py."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.bench.subject import PRESETS, build
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.dispatch.mask_envelope import KEY_BOUND_NONE
from kiln.ir.plan import RegionKind


def _regions(plan):
    attn = [r for r in plan.regions if r.kind == RegionKind.ATTENTION]
    bounds = {v for r in attn for v in r.key_bound_values()}
    env = [r for r in plan.regions if set(r.outputs) & bounds]
    return attn, env


def test_layers_reading_one_mask_share_one_envelope():
    """kiln bench's model: every layer's SDPA reads causal[None, None, input_pos]."""
    model = build(PRESETS["tiny"], torch.float32, "cpu")
    args = (torch.randint(0, 256, (1, 8)), torch.arange(8))
    plan = kiln.compile(model, args, target="interpret", compile_to="dispatch")
    attn, env = _regions(plan)
    assert len(attn) == 2 and len(env) == 1
    assert attn[0].key_bounds == attn[1].key_bounds
    assert attn[0].key_bound_values() == env[0].outputs
    assert plan.regions.index(env[0]) < plan.regions.index(attn[0])
    assert all(set(r.key_bound_values()) <= set(r.inputs) for r in attn)


class TwoLayers(torch.nn.Module):
    """Each SDPA computes the same window mask from the positions in its prologue."""

    def forward(self, q, k, v, pos):
        j = torch.arange(k.shape[2])
        mask = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(y, k, v, attn_mask=mask)


def _qkv(t=5, s=12):
    return torch.randn(1, 2, t, 8), torch.randn(1, 2, s, 8), torch.randn(1, 2, s, 8)


def test_masks_built_alike_in_each_region_share_one_envelope():
    args = (*_qkv(), torch.arange(7, 12))
    plan = kiln.compile(TwoLayers(), args, target="interpret", compile_to="dispatch")
    attn, env = _regions(plan)
    assert len(attn) == 2 and len(env) == 1 and attn[0].key_bounds == attn[1].key_bounds
    exe = kiln.compile(TwoLayers(), args, target="interpret")
    args = (*_qkv(), torch.arange(2, 7))
    torch.testing.assert_close(exe(*args), TwoLayers()(*args))


class Arange(torch.nn.Module):
    def forward(self, q, k, v):
        mask = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Given(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("model,target,options", [
    (Arange(), "interpret", None),  # recognised as causal: bounds known without a mask
    (Given(), "cpu", None),  # SDPA runs as torch ops
    (Given(), "interpret", {"mask_envelope": False}),
])
def test_no_envelope(model, target, options):
    args = _qkv(5, 5) + ((torch.rand(5, 5) > 0.5,) if isinstance(model, Given) else ())
    plan = kiln.compile(model, args, target=target, options=options, compile_to="dispatch")
    attn, env = _regions(plan)
    assert len(attn) == 1 and attn[0].key_bounds is None and not env
    assert [r.kind for r in plan.regions] == [RegionKind.ATTENTION]


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_the_envelope_kernel_gives_first_and_one_past_last(dtype):
    """... and how many keys each row passes unchanged (bool: True, float: exactly 0)."""
    mask = torch.rand(2, 1, 6, 70) > 0.9
    mask[0, 0, 2] = False  # no live key
    mask[1, 0, 3] = True
    given = mask if dtype == torch.bool else \
        torch.randn(mask.shape).to(dtype).masked_fill(~mask, float("-inf"))
    if dtype != torch.bool:  # some live keys unbiased: they count, the biased ones not
        given[..., ::3] = given[..., ::3].masked_fill(mask[..., ::3], 0.0)
    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 70, 8), torch.randn(2, 2, 70, 8)
    exe = kiln.compile(Given(), (q, k, v, given), target="interpret")
    (attn,), (env,) = _regions(exe.plan)
    kernel = exe.program.kplan.kernels[env.name]
    assert isinstance(kernel, TritonKernel)
    start, end, plain = attn.key_bounds
    outs = {v: torch.empty(2, 1, 6, dtype=torch.int32) for v in (start, end, plain)}
    kernel.run({env.inputs[0]: given}, outs, {})
    j = torch.arange(70)
    first = torch.where(mask, j, KEY_BOUND_NONE + j).amin(-1)
    last = torch.where(mask, j + 1, 0).amax(-1)
    assert torch.equal(outs[start], first.int()) and torch.equal(outs[end], last.int())
    passed = mask if dtype == torch.bool else given == 0
    assert torch.equal(outs[plain], passed.sum(-1).int())
    assert outs[start][0, 0, 2] >= KEY_BOUND_NONE and outs[end][0, 0, 2] == 0
