"""Integer matrix products on GPUs (torch has no CUDA kernel for them): the extern
path's replacement equals the CPU's ATen product, wrap-around included."""

import pytest
import torch

import kiln
from kiln.codegen import integer_products as ip


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.int16])
def test_products_equal_aten_on_the_cpu(dtype):
    g = torch.Generator().manual_seed(0)
    hi = 200 if dtype == torch.uint8 else 1000
    a = torch.randint(0, hi, (3, 5, 37), generator=g).to(dtype)
    b = torch.randint(0, hi, (3, 37, 4), generator=g).to(dtype)
    bias = torch.randint(0, hi, (4,), generator=g).to(dtype)
    assert torch.equal(ip.mm(a[0], b[0]), torch.mm(a[0], b[0]))
    assert torch.equal(ip.mm(a, b), torch.bmm(a, b))
    assert torch.equal(ip.addmm(bias, a[1], b[1], beta=2, alpha=3),
                       torch.addmm(bias, a[1], b[1], beta=2, alpha=3))
    assert torch.equal(ip.baddbmm(bias, a, b), torch.baddbmm(bias, a, b))


def test_long_k_is_summed_in_slices(monkeypatch):
    monkeypatch.setattr(ip, "_TEMP_ELEMENTS", 7)  # one K element per slice here
    a, b = torch.randint(-9, 9, (2, 300)), torch.randint(-9, 9, (300, 3))
    assert torch.equal(ip.mm(a, b), a @ b)


def test_only_integer_products_off_the_cpu_are_replaced():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ip.integer_product("aten.mm.default", torch.int64, cuda) is ip.mm
    assert ip.integer_product("aten.mm.default", torch.int64, cpu) is None
    assert ip.integer_product("aten.mm.default", torch.float16, cuda) is None
    assert ip.integer_product("aten.add.Tensor", torch.int64, cuda) is None


class IntMatmul(torch.nn.Module):
    def forward(self, a, b, c):
        return (a @ b + c, torch.addmm(c, a[0], b[0]))


@pytest.mark.gpu
def test_integer_matmul_model_runs_on_the_gpu():
    a, b = torch.randint(-50, 50, (2, 6, 9)), torch.randint(-50, 50, (2, 9, 5))
    c = torch.randint(-50, 50, (5,))
    exe = kiln.compile(IntMatmul(), (a.cuda(), b.cuda(), c.cuda()), target="cuda")
    for out, ref in zip(exe(a.cuda(), b.cuda(), c.cuda()), IntMatmul()(a, b, c)):
        assert torch.equal(out.cpu(), ref)
