"""What the torch-ops kernel (the CPU target, the extern path) does with awkward inputs.

A transposed input reaches an op as a strided view (kiln's values have no strides);
native_group_norm refused one with a raw RuntimeError at run time (the fuzzer's issue
11, item 10), and view_as_complex a slice the model had made .contiguous(). An index
the user's data puts past its dim is IndexOutOfRangeError at the model's line, an
IndexError as in eager, not a raw error from inside kiln.
"""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.errors import IndexOutOfRangeError


class GroupNormOfTranspose(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.b = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (F.group_norm(x.transpose(0, 1), 2, self.w, self.b),
                F.group_norm(x.permute(1, 0, 2), 4))


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_group_norm_of_a_transposed_input(target):
    model = GroupNormOfTranspose().eval()
    x = torch.randn(4, 4, 3)
    exe = kiln.compile(model, (x,), target=target)
    with torch.no_grad():
        for out, ref in zip(exe(x), model(x)):
            torch.testing.assert_close(out, ref)


class ComplexOfASlice(torch.nn.Module):
    def forward(self, x):
        z = torch.view_as_complex(x[:, :2].contiguous())
        return z.abs(), torch.view_as_real(z * z).sum(-1)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_view_as_complex_of_a_slice(target):
    x = torch.randn(4, 3)
    exe = kiln.compile(ComplexOfASlice(), (x,), target=target)
    for out, ref in zip(exe(x), ComplexOfASlice()(x)):
        torch.testing.assert_close(out, ref)


class Lookup(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.table = torch.nn.Parameter(torch.randn(6, 4), requires_grad=False)

    def forward(self, ids, rows):
        return self.emb(ids) + torch.index_select(self.table, 0, rows)


def test_index_past_the_dim_names_the_op_and_line():
    model = Lookup().eval()
    exe = kiln.compile(model, (torch.tensor([1, 2]), torch.tensor([0, 5])))
    with pytest.raises(IndexOutOfRangeError) as e:
        exe(torch.tensor([1, 10]), torch.tensor([0, 5]))
    assert isinstance(e.value, IndexError)  # eager raises IndexError for the same call
    assert "aten.embedding.default" in e.value.what and "self.emb(ids)" in e.value.where
    with pytest.raises(IndexOutOfRangeError, match="index_select"):
        exe(torch.tensor([1, 2]), torch.tensor([0, 6]))
    with pytest.raises(IndexOutOfRangeError):
        exe(torch.tensor([-1, 2]), torch.tensor([0, 5]))  # as eager: no negative ids here
    ok = (torch.tensor([9, 0]), torch.tensor([5, 0]))
    torch.testing.assert_close(exe(*ok), model(*ok))
