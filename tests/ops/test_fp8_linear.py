"""kiln.ops.fp8_linear against dequantise-then-matmul in fp32 (within fp8's quantisation
error) and against the same quantisation written out here; the weight quantiser; kept
whole by torch.export; bad input refused with kiln's errors."""

import pytest
import torch

from kiln.errors import DTypeError, KilnError, ShapeError
from kiln.ops import fp8_linear, quantize_weight
from kiln.ops.fp8_linear import dequantize_weight, quantize_activations
from tests.helpers import rel_err


def weight(N, K, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(N, K, generator=gen) * 0.05


@pytest.mark.parametrize("N,K,lead,dtype", [
    (256, 384, (4,), torch.float32),  # whole blocks
    (200, 300, (2, 3), torch.float32),  # tails in N and K, a 3-d x
    (130, 260, (1,), torch.bfloat16),  # one token, bf16
    (64, 100, (5,), torch.float16),  # a single, partial block
])
def test_close_to_the_dequantised_fp32_product(N, K, lead, dtype):
    w = weight(N, K)
    wq, ws = quantize_weight(w)
    bias = torch.randn(N)
    x = torch.randn(*lead, K).to(dtype)
    y = fp8_linear(x, wq, ws, bias)
    assert y.shape == (*lead, N) and y.dtype == dtype
    exact = x.float() @ w.t() + bias  # the weight before quantisation
    dequantised = x.float() @ dequantize_weight(wq, ws).t() + bias
    assert rel_err(y, dequantised) <= 3e-2  # x's quantisation only
    assert rel_err(y, exact) <= 5e-2  # both quantisations


def test_matches_the_quantisation_written_out():
    """Each 128-wide group of each token: times 448 / amax, rounded to e4m3, its scale
    amax / 448; each block product scaled by both scales."""
    N, K = 70, 200
    wq, ws = quantize_weight(weight(N, K, seed=1))
    x = torch.randn(3, K)
    want = torch.zeros(3, N, dtype=torch.float64)
    for k0 in range(0, K, 128):
        xb = x[:, k0:k0 + 128]
        amax = xb.abs().amax(1, keepdim=True)
        s = amax / 448
        q = (xb * (448 / amax)).to(torch.float8_e4m3fn).double()
        wscale = ws[:, k0 // 128].repeat_interleave(128)[:N].double()
        want += (q @ wq[:, k0:k0 + 128].double().t()) * s.double() * wscale
    assert rel_err(fp8_linear(x, wq, ws), want) <= 1e-6


def test_quantisers_fill_e4m3s_range_per_block():
    w = weight(200, 300, seed=2)
    w[0, 0] = 3.0  # one large value sets only its own block's scale
    wq, ws = quantize_weight(w)
    assert wq.dtype == torch.float8_e4m3fn and ws.shape == (2, 3) and ws.dtype == torch.float32
    assert ws[0, 0] == pytest.approx(3.0 / 448) and ws[0, 1] < 0.01
    assert rel_err(dequantize_weight(wq, ws), w) <= 4e-2
    x = torch.randn(2, 300)
    xq, xs = quantize_activations(x)
    assert xq.dtype == torch.float8_e4m3fn and xs.shape == (2, 3)
    for g in range(3):  # the largest magnitude of each group maps to 448
        group = xq[:, g * 128:(g + 1) * 128].float().abs()
        assert torch.equal(group.amax(1), torch.full((2,), 448.0))
    zero_q, zero_s = quantize_activations(torch.zeros(1, 128))
    assert torch.all(zero_q.float() == 0) and torch.all(zero_s > 0)  # no 0 / 0


def test_torch_export_keeps_one_node():
    wq, ws = quantize_weight(weight(32, 128))

    class Linear(torch.nn.Module):
        def forward(self, x):
            return fp8_linear(x, wq, ws)

    ep = torch.export.export(Linear(), (torch.randn(2, 128),))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == ["kiln.fp8_linear.default"]


def test_bad_input_is_refused_clearly():
    wq, ws = quantize_weight(weight(200, 300))
    x = torch.randn(2, 300)
    with pytest.raises(DTypeError, match="float8_e4m3fn"):
        fp8_linear(x, weight(200, 300), ws)  # a real weight
    with pytest.raises(ShapeError, match="expects K = 300"):
        fp8_linear(torch.randn(2, 256), wq, ws)
    with pytest.raises(ShapeError, match=r"needs \[2, 3\]"):
        fp8_linear(x, wq, ws[:, :2])
    with pytest.raises(DTypeError, match="weight_scale_inv"):
        fp8_linear(x, wq, ws.half())
    with pytest.raises(DTypeError, match="x has dtype torch.int64"):
        fp8_linear(x.long(), wq, ws)
    with pytest.raises(ShapeError, match=r"bias must be a \[200\]"):
        fp8_linear(x, wq, ws, torch.zeros(300))
    with pytest.raises(ShapeError, match="2-d"):
        quantize_weight(torch.randn(4, 4, 4))
    with pytest.raises(KilnError, match="quantize a float16"):
        quantize_weight(torch.ones(4, 4, dtype=torch.int32))


@pytest.mark.parametrize("K,lead,dtype", [(300, (2, 3), torch.float32),
                                          (256, (5,), torch.bfloat16)])
def test_the_linear_is_its_two_halves_exactly(K, lead, dtype):
    """kiln::fp8_quantize then kiln::fp8_scaled_mm (what the graph stage splits a
    prefill linear into) gives fp8_linear's result bit for bit."""
    wq, ws = quantize_weight(weight(130, K, seed=3))
    bias, x = torch.randn(130), torch.randn(*lead, K).to(dtype)
    xq, xs = torch.ops.kiln.fp8_quantize(x)
    assert xq.shape == x.shape and xs.shape == (*lead, -(-K // 128))
    assert xq.dtype == torch.float8_e4m3fn and xq.is_contiguous()
    y = torch.ops.kiln.fp8_scaled_mm(xq, xs, wq, ws, bias, dtype)
    assert y.dtype == dtype and torch.equal(y, fp8_linear(x, wq, ws, bias))
