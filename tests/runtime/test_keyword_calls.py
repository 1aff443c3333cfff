"""A module compiled from keyword tensors (LLM.forward calls its modules so) takes them
by name on the fast path, in any order; wrong keywords still get the ArgumentError."""

import pytest
import torch

import kiln
from kiln.errors import ArgumentError


class Two(torch.nn.Module):
    def forward(self, tokens, input_pos):
        return tokens * 2 + input_pos


@pytest.fixture(scope="module")
def exe():
    ex = {"tokens": torch.randn(2, 3), "input_pos": torch.randn(2, 3)}
    return kiln.compile(Two(), (), ex)


def test_keywords_in_any_order_match_eager(exe):
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    want = Two()(a, b)
    assert exe._flat_kw == ("tokens", "input_pos")
    assert torch.equal(exe(tokens=a, input_pos=b), want)
    assert torch.equal(exe(input_pos=b, tokens=a), want)


@pytest.mark.parametrize("kwargs, message", [
    ({"tokens": 1}, "missing ['input_pos']"),
    ({"tokens": 1, "input_pos": 1, "extra": 1}, "unexpected ['extra']"),
    ({"tokens": 1, "input_pos": [1.0]}, "structure differs"),
])
def test_wrong_keywords_are_refused(exe, kwargs, message):
    kwargs = {k: torch.randn(2, 3) if v == 1 else v for k, v in kwargs.items()}
    with pytest.raises(ArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        exe(**kwargs)
