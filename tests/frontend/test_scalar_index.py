"""Indexing with a tensor's value (`self.table[x.argmax()]`) compiles as an index op.

Export captured it as `.item()` (an unbacked int) and a select; the import stage
ended in a raw AttributeError (the fuzzer's issue 11, item 9). It now runs as
aten.index on the 0-dim tensor, with eager's semantics: negative positions wrap, a
position past the dim is an IndexError (kiln's IndexOutOfRangeError) on the CPU.
"""

import pytest
import torch

import kiln
from kiln.errors import IndexOutOfRangeError


class PickRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = torch.nn.Parameter(torch.randn(32, 5, generator=g), requires_grad=False)

    def forward(self, x):
        best = x.argmax()
        return (self.table[best] * 2, self.table[:, x.argmax(1)[0] % 5],
                self.table[x.argmax(1, keepdim=True)[:1, :1].item()])


class ByIndex(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(8, 3), requires_grad=False)

    def forward(self, i):
        return self.table[i]


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_select_by_a_tensors_value_matches_eager(target):
    model = PickRows().eval()
    exe = kiln.compile(model, (torch.randn(4, 8),), target=target)
    ops = {op.target for r in exe.plan.regions for op in r.ops}
    assert "aten.index.Tensor" in ops and "aten._local_scalar_dense.default" not in ops
    for seed in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
        for out, ref in zip(exe(x), model(x)):
            assert torch.equal(out, ref)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_negative_and_one_element_positions(target):
    model = ByIndex().eval()
    for example in (torch.tensor(3), torch.tensor([5])):
        exe = kiln.compile(model, (example,), target=target)
        for i in (0, 7, -1, -8):
            idx = torch.full_like(example, i)
            assert torch.equal(exe(idx), model(idx))


def test_position_past_the_dim_is_an_index_error():
    exe = kiln.compile(ByIndex().eval(), (torch.tensor(3),))
    with pytest.raises(IndexOutOfRangeError) as e:
        exe(torch.tensor(8))
    assert isinstance(e.value, IndexError)  # what eager raises for the same call
    assert "test_scalar_index.py" in e.value.where and "self.table[i]" in e.value.where


def test_subscripts_by_0d_tensors_become_index_ops_with_eagers_meaning():
    """The mode export traces under (torch 2.11 fails in its own subscript there): a
    subscript of 0-d integer tensors and whole-dim slices is aten.index, equal to
    eager's subscript; every other subscript is eager's own."""
    from kiln.frontend.tensor_index import TensorPositions

    x = torch.randn(6, 5, 4)
    t, s = torch.tensor(-2), torch.tensor(3, dtype=torch.int32)
    cases = [lambda: x[t], lambda: x[:, s], lambda: x[t, :, s], lambda: x[t, s],
             lambda: x[2], lambda: x[1:3, t], lambda: x[torch.tensor(True)],
             lambda: x[torch.tensor([1, 4])]]
    for case in cases:
        want = case()
        with TensorPositions():
            got = case()
        assert torch.equal(got, want)
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Spy(), TensorPositions():
        x[t, :, s], x[1:3, t]
    assert torch.ops.aten.index.Tensor in seen  # the first, rewritten
    assert seen.count(torch.Tensor.__getitem__) == 1  # the second, left to torch
    with TensorPositions(), pytest.raises(IndexError):
        x[torch.tensor(6)]
