"""An fp8 linear over more tokens than a decode step is split into quantise-once and
the block-scaled GEMM (kiln.graph.split_fp8_linear); a decode-sized one stays whole."""

import pytest
import torch

from kiln.graph.split_fp8_linear import DECODE_TOKENS, split_fp8_linear
from kiln.ops import fp8_linear, quantize_weight
from tests.graph.util import Dim, apply, assert_same_as_eager, graph_of, ops


class Linear(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        w, s = quantize_weight(torch.randn(96, 200) * 0.05)
        self.weight = torch.nn.Parameter(w, requires_grad=False)
        self.register_buffer("weight_scale_inv", s)
        self.bias = torch.nn.Parameter(torch.randn(96)) if bias else None

    def forward(self, x):
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias) * 2


SPLIT = ["kiln.fp8_quantize.default", "getitem", "getitem", "kiln.fp8_scaled_mm.default",
         "aten.mul.Tensor"]
WHOLE = ["kiln.fp8_linear.default", "aten.mul.Tensor"]


@pytest.mark.parametrize("most,want", [(DECODE_TOKENS // 2, WHOLE),
                                       (DECODE_TOKENS // 2 + 1, SPLIT)])
def test_tokens_above_a_decode_step_split(most, want):
    m, x = Linear(bias=True), torch.randn(2, 7, 200, dtype=torch.bfloat16)
    kg = graph_of(m, x, dynamic=({1: Dim("T", min=1, max=most)},))
    kg = apply(split_fp8_linear, kg)
    assert ops(kg) == want  # 2 x T tokens: at most 2 x `most`
    assert_same_as_eager(kg, m, (x,))


def test_a_static_prefill_splits_and_computes_the_same():
    m, x = Linear(bias=False), torch.randn(130, 200)
    kg = apply(split_fp8_linear, graph_of(m, x))
    assert ops(kg) == SPLIT
    mm = next(n for n in kg.graph.nodes if "scaled_mm" in str(n.target))
    assert mm.args[4] is None and mm.args[5] == torch.float32  # no bias, x's dtype out
    assert_same_as_eager(kg, m, (x,))
    assert ops(apply(split_fp8_linear, graph_of(m, x[:DECODE_TOKENS]))) == WHOLE
