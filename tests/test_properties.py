"""Property tests: random chains of pointwise and reduction ops (with a few views)
over random shapes of rank 1-4 compile for the CPU and match eager PyTorch at 1e-5.

Examples are derandomized so CI sees the same 25 programs every run; a failure
prints the program (shape and steps) to reproduce it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.export import Dim

import kiln
from tests.helpers import assert_close_tree

UNARY = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "sin": torch.sin,
    "neg": torch.neg,
    "abs": torch.abs,
    "relu": torch.relu,
    "square": lambda h: h * h,
    "affine": lambda h: h * 0.5 + 1.0,
    "exp_tanh": lambda h: torch.exp(torch.tanh(h)),
    "sqrt": lambda h: torch.sqrt(h.abs() + 1.0),
    "rsqrt": lambda h: torch.rsqrt(h * h + 1.0),
}
REDUCE = {
    "sum": lambda h, d, k: h.sum(d, keepdim=k),
    "mean": lambda h, d, k: h.mean(d, keepdim=k),
    "amax": lambda h, d, k: h.amax(d, keepdim=k),
    "amin": lambda h, d, k: h.amin(d, keepdim=k),
    "var": lambda h, d, k: h.var(d, keepdim=k, correction=0),
}
BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul}


class Chain(nn.Module):
    """Applies `steps` to x; each step is a tuple naming an op and its arguments."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def forward(self, x):
        h = x
        for step in self.steps:
            kind = step[0]
            d = step[-1] % h.dim() if h.dim() else None
            if kind == "unary":
                h = UNARY[step[1]](h)
            elif h.dim() == 0:
                h = h * 2.0
            elif kind == "reduce":
                h = REDUCE[step[1]](h, d, step[2])
            elif kind == "center":  # h op reduce(h) broadcast back over the reduced axis
                h = BINARY[step[1]](h, REDUCE[step[2]](h, d, True))
            elif kind == "softmax":
                h = torch.softmax(h, d) if step[1] else torch.log_softmax(h, d)
            elif kind == "transpose":
                h = h.transpose(d, step[1] % h.dim()) * 1.5
            elif kind == "there_and_back":  # views around pointwise ops: passes cancel them
                e = step[1] % h.dim()
                h = torch.sin(h.transpose(d, e) + 1).transpose(d, e)
                h = torch.tanh(h.reshape(-1) * 2).reshape(h.shape)
        return h, x.sum() * h.sum()  # also a full reduction mixing input and result


_dim = st.integers(0, 3)
STEPS = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY)), _dim),
    st.tuples(st.just("reduce"), st.sampled_from(sorted(REDUCE)), st.booleans(), _dim),
    st.tuples(st.just("center"), st.sampled_from(sorted(BINARY)),
              st.sampled_from(sorted(REDUCE)), _dim),
    st.tuples(st.just("softmax"), st.booleans(), _dim),
    st.tuples(st.just("transpose"), _dim, _dim),
    st.tuples(st.just("there_and_back"), _dim, _dim),
)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       steps=st.lists(STEPS, min_size=1, max_size=5),
       dynamic=st.booleans())
def test_random_chains_match_eager(shape, steps, dynamic):
    model = Chain(steps)
    x = torch.randn(shape)
    dyn = None
    calls = []
    if dynamic and shape[0] >= 2:
        dyn = ({0: Dim("N", min=2, max=16)},)
        calls.append((torch.randn([shape[0] + 3, *shape[1:]]),))
    exe = kiln.compile(model, (x,), dynamic_shapes=dyn)
    for args in [(x,), *calls]:
        assert_close_tree(exe(*args), model(*args), 1e-5)
