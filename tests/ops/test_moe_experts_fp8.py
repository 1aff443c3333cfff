"""kiln.ops.moe_experts_fp8 against a per-token loop over chosen experts written out here
in float64 (weights dequantised from their blocks, activations quantised as
kiln.ops.fp8_linear does, everything else float64), and against the bf16/fp32 op on the
dequantised weights (within fp8's activation rounding); dims with tail blocks, experts
without tokens, torch.export keeps it whole; bad input is refused with kiln's errors."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import DTypeError, ShapeError
from kiln.ops import moe_experts, moe_experts_fp8, quantize_experts
from kiln.ops.fp8_linear import dequantize_weight, quantize_activations
from tests.helpers import rel_err
from tests.ops.test_moe_experts import make


def make_fp8(N, dim, E, inter, k, seed=0, dtype=torch.float32):
    """(x, weights, ids, gate, gate_scale, up, up_scale, down, down_scale) and the
    dequantised (gate, up, down) in fp32."""
    x, w, ids, gate, up, down = make(N, dim, E, inter, k, seed=seed)
    fp8 = [quantize_experts(t) for t in (gate, up, down)]
    real = [torch.stack([dequantize_weight(q[e], s[e]) for e in range(E)]) for q, s in fp8]
    return (x.to(dtype), w, ids, *fp8[0], *fp8[1], *fp8[2]), real


def _fake_quantised(v: torch.Tensor) -> torch.Tensor:
    """v as fp8_linear's activation quantisation leaves it, in float64."""
    q, s = quantize_activations(v)
    return q.double() * s.double().repeat_interleave(128, -1)[..., :v.shape[-1]]


def loop_reference(args, real):
    """Each token, each choice, one expert at a time: float64 but for the two fp8
    quantisations of the activations and g, u, h rounded to x's dtype (where
    fp8_linear's outputs are)."""
    x, weights, ids = args[:3]
    gate, up, down = (t.double() for t in real)
    y = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        xn = _fake_quantised(x[n:n + 1].float())[0]
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            g, u = ((w[e] @ xn).to(x.dtype).double() for w in (gate, up))
            h = (F.silu(g) * u).to(x.dtype)
            y[n] += float(weights[n, j]) * (down[e] @ _fake_quantised(h[None].float())[0])
    return y


@pytest.mark.parametrize("N,dim,E,inter,k", [(7, 256, 4, 128, 2), (5, 200, 6, 136, 3),
                                             (1, 128, 3, 64, 2)])
def test_matches_the_float64_loop_and_the_dequantised_op(N, dim, E, inter, k):
    args, real = make_fp8(N, dim, E, inter, k, seed=N)
    y = moe_experts_fp8(*args)
    assert y.shape == (N, dim) and y.dtype == torch.float32
    assert rel_err(y, loop_reference(args, real)) <= 1e-5
    # fp8 activations against real ones: e4m3's 3 mantissa bits, a few percent
    assert rel_err(y, moe_experts(*args[:3], *real)) <= 0.08


def test_each_product_is_fp8_linear():
    """One token on one expert: exactly fp8_linear's chain."""
    args, _ = make_fp8(1, 256, 2, 128, 1, seed=4)
    x, w, ids, g, gs, u, us, d, ds = args
    e = int(ids[0, 0])
    lin = kiln.ops.fp8_linear
    h = F.silu(lin(x, g[e], gs[e])) * lin(x, u[e], us[e])
    want = lin(h, d[e], ds[e]) * w[0, 0]
    assert torch.equal(moe_experts_fp8(*args), want)


def test_bfloat16_and_idle_experts():
    args, real = make_fp8(9, 256, 8, 128, 2, seed=2, dtype=torch.bfloat16)
    args = list(args)
    args[2] = torch.tensor([[1, 6]] * 9)  # experts 0, 2-5 and 7 get nothing
    y = moe_experts_fp8(*args)
    assert y.dtype == torch.bfloat16
    # h quantised again: a bf16 rounding difference moves a value a whole e4m3 step
    assert rel_err(y, loop_reference(args, real)) <= 2e-2


class Fp8Experts(torch.nn.Module):
    def __init__(self, *weights):
        super().__init__()
        self.w = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False)
                                         for t in weights])

    def forward(self, x, weights, ids):
        return moe_experts_fp8(x, weights, ids, *self.w)


def test_export_keeps_it_whole_with_dynamic_tokens():
    args, _ = make_fp8(6, 128, 5, 64, 2, seed=3)
    m = Fp8Experts(*args[3:])
    T = kiln.Dim("T", min=1, max=32)
    exe = kiln.compile(m, args[:3], dynamic_shapes=({0: T}, {0: T}, {0: T}))
    ops = [op.target for r in exe.plan.regions for op in r.ops]
    assert "kiln.moe_experts_fp8.default" in ops
    for n in (1, 17):
        call, _ = make_fp8(n, 128, 5, 64, 2, seed=3)
        call = (call[0] * 0 + torch.randn(n, 128), *call[1:3])
        assert torch.equal(exe(*call), m(*call)), n


def test_bad_input_is_refused():
    args, _ = make_fp8(4, 128, 3, 64, 2)
    x, w, ids, g, gs, u, us, d, ds = args
    with pytest.raises(DTypeError, match=r"gate has dtype torch.float32; it must be "
                       r"torch.float8_e4m3fn"):
        moe_experts_fp8(x, w, ids, g.float(), gs, u, us, d, ds)
    with pytest.raises(ShapeError, match=r"up_scale has shape \[3, 1, 2\]; up \[3, 64, 128\]"
                       r" in 128x128 blocks needs \[3, 1, 1\]"):
        moe_experts_fp8(x, w, ids, g, gs, u, torch.ones(3, 1, 2), d, ds)
    with pytest.raises(ShapeError, match=r"down_scale has shape \[2, 1, 1\]"):
        moe_experts_fp8(x, w, ids, g, gs, u, us, d, ds[:2])
    with pytest.raises(DTypeError, match="gate_scale has dtype torch.bfloat16"):
        moe_experts_fp8(x, w, ids, g, gs.bfloat16(), u, us, d, ds)
    with pytest.raises(ShapeError, match=r"down has shape \[3, 64, 128\]"):
        moe_experts_fp8(x, w, ids, g, gs, u, us, d.transpose(1, 2), ds)
    with pytest.raises(ShapeError, match=r"expert 3, outside \[0, 3\)"):
        moe_experts_fp8(x, w, ids + 1, g, gs, u, us, d, ds)
    with pytest.raises(ShapeError, match="stacked experts must be 3-d"):
        quantize_experts(torch.randn(4, 4))
