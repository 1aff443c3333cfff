"""Generated kernels on the `interpret` target give eager's values where Triton's
interpreter alone does not: comparisons broadcast as booleans, and casts between bf16
and integers or booleans convert values, not bits (the fuzzer's classes 11-15)."""

from __future__ import annotations

import pytest
import torch

import kiln


class Logic(torch.nn.Module):
    def forward(self, a, b):
        return torch.logical_and(a, b), torch.logical_or(a, b), torch.minimum(a, b), \
            torch.maximum(b, a)


@pytest.mark.parametrize("shapes", [((1, 1, 1, 3), (1,)), ((2, 3), (3,)), ((5,), (1,))])
def test_logic_and_nan_propagating_min_max_with_a_broadcast_operand(shapes):
    a, b = torch.randn(shapes[0]).half(), torch.randn(shapes[1]).half()
    a.view(-1)[0] = float("nan")
    got = kiln.compile(Logic(), (a, b), target="interpret")(a, b)
    for x, y in zip(got, Logic()(a, b)):
        assert torch.equal(x, y) or torch.allclose(x.float(), y.float(), equal_nan=True)


class Casts(torch.nn.Module):
    def forward(self, ints, flags, halves):
        return (ints.to(torch.bfloat16) * 2, flags.t().to(torch.bfloat16) + 1,
                halves.to(torch.int32) + 1, torch.eye(4, dtype=torch.bfloat16) + halves,
                (ints.float() * 1.001).to(torch.bfloat16))  # fp32 -> bf16 rounds to even


def test_bf16_casts_from_and_to_integers_and_booleans():
    ints = torch.randint(-300, 300, (4, 4))
    flags = torch.rand(4, 4) < 0.5
    halves = (torch.randn(4, 4) * 100).to(torch.bfloat16)
    got = kiln.compile(Casts(), (ints, flags, halves), target="interpret")(ints, flags, halves)
    for x, y in zip(got, Casts()(ints, flags, halves)):
        assert torch.equal(x, y)
