"""Example inputs that share memory: torch.export traces them as one value.

`kiln.compile(model, (x, x))` is a natural way to write a quick test; export made
`forward(x, y): x + y` into `y + y`, and every later call with two different tensors
ignored the first (a silent wrong answer, found by tests/no_raw_exceptions). kiln now
hands export a copy of every input that shares memory with an earlier one.
"""

import pytest
import torch

import kiln


class Add(torch.nn.Module):
    def forward(self, x, y):
        return x + y * 2


class Keywords(torch.nn.Module):
    def forward(self, x, *, scale):
        return x * scale


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_the_same_tensor_twice(target):
    x = torch.randn(4, 3)
    exe = kiln.compile(Add(), (x, x), target=target)
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    torch.testing.assert_close(exe(a, b), a + b * 2)


def test_a_view_of_another_input_and_a_keyword_alias():
    x = torch.randn(4, 3)
    exe = kiln.compile(Add(), (x, x[1]))
    a, b = torch.randn(4, 3), torch.randn(3)
    torch.testing.assert_close(exe(a, b), a + b * 2)
    exe = kiln.compile(Keywords(), (x,), {"scale": x})
    torch.testing.assert_close(exe(a, scale=b.expand(4, 3).contiguous()), a * b)
