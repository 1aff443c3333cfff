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


class ProjectionRegion:
    """Projection's matmul region (permute the weight, view x, mm, view) as a TorchKernel
    run on chosen inputs: `run(w, x)` gives the output, reshaped to x's rows."""

    def __init__(self):
        from kiln.codegen.torch_kernel import TorchKernel

        plan = kiln.compile(Projection().eval(), (torch.randn(2, 3, 8),), target="cpu",
                            compile_to="dispatch")
        (region,) = [r for r in plan.regions
                     if any(o.target == "aten.mm.default" for o in r.ops)]
        self.w = next(v for v in region.inputs if tuple(plan.values[v].shape) == (6, 8))
        self.x = next(v for v in region.inputs if v != self.w)
        self.kernel = TorchKernel(region)
        (self.out,) = region.outputs
        self.got = {self.out: torch.empty(tuple(plan.values[self.out].shape))}

    def run(self, w, x):
        self.kernel.run({self.w: w, self.x: x}, self.got, {})
        return self.got[self.out].clone().reshape(2, 3, 6)

    def kept(self):
        return [s[8][2] for s in self.kernel._last[1].steps if s[6] == "view"]


def test_views_of_an_unchanged_input_are_kept_and_follow_a_new_one():
    """The permuted weight and the viewed activation are made once while their sources
    stay the same tensors; a new weight tensor, or one written in place, is used."""
    proj, x, w = ProjectionRegion(), torch.randn(2, 3, 8), torch.randn(6, 8)
    first = proj.run(w, x)
    kept = proj.kept()
    assert kept and all(k is not None for k in kept)
    torch.testing.assert_close(proj.run(w, x), first)
    assert proj.kept() == kept  # the same objects
    torch.testing.assert_close(first, x @ w.t())
    w.mul_(2)  # in place: the kept view sees it
    torch.testing.assert_close(proj.run(w, x), x @ w.t())
    other = torch.randn(6, 8)  # another tensor: viewed afresh
    torch.testing.assert_close(proj.run(other, x), x @ other.t())


def test_a_reshape_that_copies_is_not_kept():
    """A strided input whose view needs a copy is copied again on every call."""
    proj, w = ProjectionRegion(), torch.randn(6, 8)
    strided = torch.randn(8, 3, 2).permute(2, 1, 0)  # [2, 3, 8], not contiguous
    proj.run(w, strided)
    strided.mul_(-1)
    torch.testing.assert_close(proj.run(w, strided), strided @ w.t())


class PooledTranspose(torch.nn.Module):
    """SEW's pattern: pool a transposed activation, then a norm over channels."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        pooled = F.avg_pool1d(x.transpose(1, 2), 2)
        return self.norm(pooled.transpose(1, 2) + 1)


def test_an_out_kernel_that_restrides_its_out_tensor():
    """CUDA's pooling kernels restride the out= tensor to the input's memory format
    (channels last for a transposed input); a generated kernel reading the planned
    buffer densely got scrambled values on an H200. Here a CPU avg_pool2d.out does the
    same, so the interpret target shows it."""
    def restriding_avg_pool2d(x, kernel, stride=(), padding=0, ceil_mode=False,
                              count_include_pad=True, divisor_override=None, *, out):
        result = torch.ops.aten.avg_pool2d.default(x, kernel, stride, padding, ceil_mode,
                                                   count_include_pad, divisor_override)
        out.as_strided_(out.shape, result.contiguous(memory_format=torch.channels_last)
                        .stride(), out.storage_offset())
        return out.copy_(result)

    model = PooledTranspose().eval()
    x = torch.randn(2, 6, 8)
    exe = kiln.compile(model, (x,), target="interpret")
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("avg_pool2d.out", restriding_avg_pool2d, "CPU")
    try:
        probe = torch.empty(2, 8, 1, 3)
        torch.ops.aten.avg_pool2d.out(x.transpose(1, 2).unsqueeze(2), [1, 2], [1, 2],
                                      out=probe)
        assert probe.stride() != (24, 3, 3, 1)  # the override does restride
        for _ in range(2):
            fresh = torch.randn(2, 6, 8)
            with torch.no_grad():
                torch.testing.assert_close(exe(fresh), model(fresh))
    finally:
        lib._destroy()
