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


class Projection(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 6, bias=False)

    def forward(self, x):
        return self.proj(x).reshape(-1)


def _matmul_region(model, x):
    plan = kiln.compile(model, (x,), target="cpu", compile_to="dispatch")
    (region,) = [r for r in plan.regions if any(o.target == "aten.mm.default" for o in r.ops)]
    return plan, region


def test_views_of_an_unchanged_input_are_kept_and_follow_a_new_one():
    """The permuted weight and the viewed activation are made once while their sources
    stay the same tensors; a new weight tensor, or one written in place, is used."""
    from kiln.codegen.torch_kernel import TorchKernel

    model, x = Projection().eval(), torch.randn(2, 3, 8)
    plan, region = _matmul_region(model, x)
    w_name = next(v for v in region.inputs if tuple(plan.values[v].shape) == (6, 8))
    x_name = next(v for v in region.inputs if v != w_name)
    kernel = TorchKernel(region)
    (out,) = region.outputs
    got = {out: torch.empty(tuple(plan.values[out].shape))}
    w = torch.randn(6, 8)
    inputs = {w_name: w, x_name: x}

    def run():
        kernel.run(inputs, got, {})
        return got[out].clone()

    first = run()
    bound = kernel._last[1]
    kept = [s[8][2] for s in bound.steps if s[6] == "view"]
    assert kept and all(k is not None for k in kept)
    torch.testing.assert_close(run(), first)
    assert [s[8][2] for s in bound.steps if s[6] == "view"] == kept  # the same objects
    torch.testing.assert_close(first.reshape(2, 3, 6), x @ w.t())
    w.mul_(2)  # in place: the kept view sees it
    torch.testing.assert_close(run().reshape(2, 3, 6), x @ w.t())
    inputs[w_name] = torch.randn(6, 8)  # another tensor: viewed afresh
    torch.testing.assert_close(run().reshape(2, 3, 6), x @ inputs[w_name].t())


def test_a_reshape_that_copies_is_not_kept():
    """A strided input whose view needs a copy is copied again on every call."""
    from kiln.codegen.torch_kernel import TorchKernel

    model, x = Projection().eval(), torch.randn(2, 3, 8)
    plan, region = _matmul_region(model, x)
    w_name = next(v for v in region.inputs if tuple(plan.values[v].shape) == (6, 8))
    x_name = next(v for v in region.inputs if v != w_name)
    kernel = TorchKernel(region)
    (out,) = region.outputs
    got = {out: torch.empty(tuple(plan.values[out].shape))}
    w = torch.randn(6, 8)
    strided = torch.randn(8, 3, 2).permute(2, 1, 0)  # [2, 3, 8], not contiguous
    inputs = {w_name: w, x_name: strided}
    kernel.run(inputs, got, {})
    strided.mul_(-1)
    kernel.run(inputs, got, {})
    torch.testing.assert_close(got[out].reshape(2, 3, 6), strided @ w.t())
