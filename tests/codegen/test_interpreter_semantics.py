"""Generated kernels give eager's values on the fuzzer's classes: on the `interpret`
target comparisons broadcast as booleans and casts between bf16 and integers or
booleans convert values, not bits (classes 11-15); row kernels and attention whose
tiles have size-1 dims store and multiply full tiles (classes 3 and 4)."""

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


class UnitNorms(torch.nn.Module):
    def forward(self, x):
        return (torch.nn.functional.layer_norm(x, (1,), eps=1e-5),
                torch.nn.functional.rms_norm(x.unsqueeze(-1), (1,)),
                torch.softmax(x.reshape(1, 1, -1), dim=0))


@pytest.mark.parametrize("shape", [(1,), (3, 1), (1, 1, 1)])
def test_row_kernels_over_size_one_axes(shape):
    """Every index of the output is a size-1 dim: the store still needs a block pointer."""
    x = torch.randn(shape)
    got = kiln.compile(UnitNorms(), (x,), target="interpret")(x)
    for a, b in zip(got, UnitNorms()(x)):
        torch.testing.assert_close(a, b)


class Attend(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("shapes", [
    ((1, 1, 1), (1, 1, 1), (1, 1, 33), (1, 1)),  # head dim 1, one key (fuzzer class)
    ((2, 1, 3, 1), (2, 1, 5, 1), (2, 1, 5, 4), (3, 5)),  # head dim 1, padded lanes
    ((1, 2, 4, 1), (1, 2, 1, 1), (1, 2, 1, 3), (4, 1)),  # one key and head dim 1
])
def test_attention_with_size_one_tile_dims(shapes):
    args = [torch.randn(s) for s in shapes]
    got = kiln.compile(Attend(), tuple(args), target="interpret")(*args)
    torch.testing.assert_close(got, Attend()(*args), rtol=1e-5, atol=1e-5)


def test_a_k_split_loops_from_program_ids():
    """A split matmul's loop bounds are program-id arithmetic: one-element tensors that
    Triton 3.6's interpreter turned into an index with int(), which NumPy 2.4 refuses
    (kiln.codegen.build.interpreter's _scalar_index squeezes them, as later Triton)."""
    from kiln.codegen.build.interpreter import Interpreted
    from kiln.codegen.build.source import load_kernel

    source = '''import triton
import triton.language as tl


@triton.jit
def split_sums(x_ptr, out_ptr, PER: tl.constexpr):
    lo = tl.program_id(0) * PER
    acc = tl.zeros([1], tl.float32)
    for k in range(lo, lo + PER):
        acc += tl.load(x_ptr + k + tl.arange(0, 1))
    tl.store(out_ptr + tl.program_id(0) + tl.arange(0, 1), acc)
'''
    kernel = load_kernel(source, "split_sums", interpret=True)
    assert isinstance(kernel, Interpreted)
    x, out = torch.arange(12, dtype=torch.float32), torch.zeros(3)
    kernel[(3, 1, 1)](x, out, PER=4)
    assert torch.equal(out, x.view(3, 4).sum(1))
