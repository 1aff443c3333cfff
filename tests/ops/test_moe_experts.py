"""kiln.ops.moe_experts against the per-token loop over chosen experts written out here
and gathered (copied weights) and dense forms: several shapes, experts that get no token,
every token on one expert, one token, fp32 and bf16; torch.export keeps it whole with
a dynamic token count; bad input is refused with kiln's errors."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import DTypeError, ShapeError
from kiln.ops import moe_experts
from kiln.ops.moe_experts import sorted_by_expert
from tests.helpers import rel_err


def loop_reference(x, weights, ids, gate, up, down):
    """Each token, each of its k choices, one expert at a time, in float64."""
    x, gate, up, down = (t.double() for t in (x, gate, up, down))
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            h = F.silu(gate[e] @ x[n]) * (up[e] @ x[n])
            y[n] += float(weights[n, j]) * (down[e] @ h)
    return y


def gathered(x, weights, ids, gate, up, down):
    """A gathered form: the chosen experts' weights copied per token, batched matmuls."""
    h = F.silu(torch.einsum("nd,nkid->nki", x, gate[ids]))
    h = h * torch.einsum("nd,nkid->nki", x, up[ids])
    y = torch.einsum("nki,nkdi->nkd", h, down[ids])
    return (y.float() * weights[:, :, None]).sum(1).to(x.dtype)


def dense(x, weights, ids, gate, up, down):
    """kiln.models.moe's dense form: every expert on every token, zero-weighted off."""
    combine = torch.zeros(x.shape[0], gate.shape[0]).scatter(1, ids.long(), weights)
    h = F.silu(torch.einsum("nd,eid->nei", x, gate)) * torch.einsum("nd,eid->nei", x, up)
    y = torch.einsum("nei,edi->ned", h, down)
    return (y.float() * combine[:, :, None]).sum(1).to(x.dtype)


def make(N, dim, E, inter, k, seed=0, dtype=torch.float32, ids=None):
    """(x, weights, ids, gate, up, down): k distinct experts per token unless `ids`."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, dim, generator=gen)
    weights = torch.rand(N, k, generator=gen)
    if ids is None:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    scale = dim ** -0.5
    gate, up = (torch.randn(E, inter, dim, generator=gen) * scale for _ in range(2))
    down = torch.randn(E, dim, inter, generator=gen) * inter ** -0.5
    return (x.to(dtype), weights, ids, gate.to(dtype), up.to(dtype), down.to(dtype))


@pytest.mark.parametrize("N,dim,E,inter,k", [(7, 16, 4, 8, 2), (12, 24, 8, 40, 3),
                                             (1, 32, 6, 16, 4), (5, 8, 3, 4, 3)])
def test_matches_the_loop_and_the_gathered_and_dense_forms(N, dim, E, inter, k):
    args = make(N, dim, E, inter, k)
    y = moe_experts(*args)
    assert y.shape == (N, dim) and y.dtype == torch.float32
    ref = loop_reference(*args)
    assert rel_err(y, ref) <= 1e-5
    assert rel_err(gathered(*args), ref) <= 1e-5 and rel_err(dense(*args), ref) <= 1e-5


def test_experts_without_tokens_and_every_token_on_one_expert():
    x, w, _, gate, up, down = make(9, 16, 8, 12, 2)
    few = torch.tensor([[1, 6]] * 9)  # experts 0, 2-5 and 7 get nothing
    assert rel_err(moe_experts(x, w, few, gate, up, down),
                   loop_reference(x, w, few, gate, up, down)) <= 1e-5
    one = torch.full((9, 2), 3)  # the same expert twice per token: counted twice
    assert rel_err(moe_experts(x, w, one, gate, up, down),
                   loop_reference(x, w, one, gate, up, down)) <= 1e-5
    order, counts = sorted_by_expert(few, 8)
    assert counts == [0, 9, 0, 0, 0, 0, 9, 0]
    assert order[:9].tolist() == list(range(0, 18, 2))  # stable: token order kept


def test_bfloat16_against_float64():
    args = make(10, 64, 6, 32, 3, seed=1, dtype=torch.bfloat16)
    y = moe_experts(*args)
    assert y.dtype == torch.bfloat16
    assert rel_err(y, loop_reference(*args)) <= 1e-2


def test_int32_ids():
    args = list(make(6, 16, 5, 8, 2, seed=2))
    ref = moe_experts(*args)
    args[2] = args[2].int()
    assert torch.equal(moe_experts(*args), ref)


class Experts(torch.nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Parameter(t) for t in (gate, up, down))

    def forward(self, x, weights, ids):
        return moe_experts(x, weights, ids, self.gate, self.up, self.down)


def test_export_keeps_it_whole_with_dynamic_tokens():
    x, w, ids, gate, up, down = make(6, 16, 5, 8, 2, seed=3)
    m = Experts(gate, up, down)
    T = kiln.Dim("T", min=1, max=32)
    exe = kiln.compile(m, (x, w, ids), dynamic_shapes=({0: T}, {0: T}, {0: T}))
    ops = [op.target for r in exe.plan.regions for op in r.ops]
    assert "kiln.moe_experts.default" in ops
    for n in (1, 6, 17):
        x, w, ids, *_ = make(n, 16, 5, 8, 2, seed=n)
        assert rel_err(exe(x, w, ids), m(x, w, ids)) <= 1e-6, n


def test_bad_input_is_refused():
    x, w, ids, gate, up, down = make(4, 16, 5, 8, 2)
    with pytest.raises(ShapeError, match="x must be a 2-d tensor"):
        moe_experts(x[None], w, ids, gate, up, down)
    with pytest.raises(ShapeError, match=r"weights \[4, 3\] and ids \[4, 2\]"):
        moe_experts(x, torch.rand(4, 3), ids, gate, up, down)
    with pytest.raises(ShapeError, match=r"down has shape \[5, 8, 16\]"):
        moe_experts(x, w, ids, gate, up, down.transpose(1, 2))
    with pytest.raises(ShapeError, match=r"up has shape"):
        moe_experts(x, w, ids, gate, up[:4], down)
    with pytest.raises(DTypeError, match="weights has dtype torch.bfloat16"):
        moe_experts(x, w.bfloat16(), ids, gate, up, down)
    with pytest.raises(DTypeError, match="ids has dtype torch.float32"):
        moe_experts(x, w, ids.float(), gate, up, down)
    with pytest.raises(DTypeError, match="gate has dtype torch.bfloat16"):
        moe_experts(x, w, ids, gate.bfloat16(), up, down)
    with pytest.raises(DTypeError, match="x has dtype torch.int64"):
        moe_experts(x.long(), w, ids, gate, up, down)
    with pytest.raises(ShapeError, match=r"expert 5, outside \[0, 5\)"):
        moe_experts(x, w, ids.clamp(max=3) + 2, gate, up, down)
    with pytest.raises(ShapeError, match=r"expert -1"):
        moe_experts(x, w, ids - 1, gate, up, down)


def test_ids_out_of_range_contribute_nothing_in_the_op_itself():
    """What a compiled module does with ids it cannot refuse: those pairs add nothing
    (a token with none left gets zeros)."""
    x, w, ids, gate, up, down = make(4, 16, 5, 8, 2)
    bad = ids.clone()
    bad[0, 1], bad[2] = 9, torch.tensor([-1, 7])
    y = torch.ops.kiln.moe_experts(x, w, bad, gate, up, down)
    keep = w.clone()
    keep[0, 1], keep[2] = 0.0, 0.0
    assert rel_err(y, loop_reference(x, keep, bad.clamp(0, 4), gate, up, down)) <= 1e-5
    assert not y[2].any()
