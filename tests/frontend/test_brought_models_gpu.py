"""The twenty-fourth and twenty-fifth sessions' fixes on a GPU target: masked_scatter
decomposed (Llava's image placement), a check on a tensor's value, returned Nones, an
in-order as_strided (Swin's pooled output), CUDA's pooling restriding its out= tensor
(SEW); each against eager on the device."""

from __future__ import annotations

import pytest
import torch

import kiln
from tests.codegen.test_torch_kernel_inputs import PooledTranspose
from tests.frontend.test_none_outputs import SomeNone
from tests.frontend.test_strided_views import PooledTokens
from tests.frontend.test_value_checks import PlaceImages, ScatterImages, _inputs

pytestmark = pytest.mark.gpu


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("model_cls", [PlaceImages, ScatterImages])
def test_image_placement_on_cuda(model_cls):
    model = model_cls().cuda()
    exe = kiln.compile(model, tuple(t.cuda() for t in _inputs(0)), target="cuda",
                       fallback="error")
    ids, feats = (t.cuda() for t in _inputs(1))
    assert _rel(exe(ids, feats), model(ids, feats)) < 1e-5


def test_nones_and_strided_views_on_cuda():
    x = torch.randn(3, 4, device="cuda")
    got, want = kiln.compile(SomeNone(), (x,), target="cuda")(x), SomeNone()(x)
    assert got[1] is None and got[2][1] is None and torch.allclose(got[0], want[0])
    model = PooledTokens().cuda()
    x = torch.randn(2, 5, 8, device="cuda")
    exe = kiln.compile(model, (x,), target="cuda", fallback="error")
    for g, w in zip(exe(x), model(x)):
        assert _rel(g, w) < 1e-5


def test_a_pooled_transpose_read_by_a_generated_kernel_on_cuda():
    """CUDA's avg_pool2d restrides its out= tensor to channels last for a transposed
    input; the LayerNorm kernel after it read the planned buffer densely (SEW, 1.3)."""
    model = PooledTranspose().cuda().eval()
    exe = kiln.compile(model, (torch.randn(2, 6, 8, device="cuda"),), target="cuda")
    for _ in range(2):
        x = torch.randn(2, 6, 8, device="cuda")
        with torch.no_grad():
            assert _rel(exe(x), model(x)) < 1e-5
