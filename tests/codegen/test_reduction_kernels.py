"""Generated reduction kernels in Triton's interpreter vs eager: every reduction op, on
innermost, outer, middle, several and all axes, keepdim both ways, persistent and
looped, with tails in both the rows and the row elements."""

import pytest
import torch
import torch.nn.functional as F

from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from tests.codegen.gen_helpers import assert_matches, compile_interpret, triton_kernels

SMALL = torch.export.Dim("T", min=2, max=64)  # bounded: persistent rows
LARGE = torch.export.Dim("T", min=2, max=100_000)  # large bound: looped rows


class Reductions(torch.nn.Module):
    def __init__(self, dims, keepdim):
        super().__init__()
        self.dims, self.keepdim = dims, keepdim

    def forward(self, x):
        d, k = self.dims, self.keepdim
        single = d[0] if isinstance(d, tuple) else d
        outs = [x.sum(d, keepdim=k), x.mean(d, keepdim=k), x.amax(d, keepdim=k),
                x.amin(d, keepdim=k), torch.var(x, d, keepdim=k),
                torch.var(x, d, keepdim=k, correction=0), (x > 0.5).any(single, keepdim=k),
                (x > -2).all(single, keepdim=k), (x * 0.5 + 1).prod(single, keepdim=k),
                x.argmax(single, keepdim=k), x.argmin(single, keepdim=k)]
        values, idx = x.max(single, keepdim=k)
        norms = [torch.linalg.vector_norm(x, o, d, keepdim=k) for o in (2, 1, 3, float("inf"))]
        return (*outs, values, idx, torch.logsumexp(x, single, keepdim=k), *norms)


LAYOUTS = [((2,), False), ((2,), True), ((0,), False), ((1,), True), ((0, 2), False),
           ((0, 1, 2), False)]


@pytest.mark.parametrize("dims,keepdim", LAYOUTS, ids=[f"{d}-{k}" for d, k in LAYOUTS])
def test_reductions_over_every_axis_layout(dims, keepdim):
    model = Reductions(dims, keepdim)
    x = torch.randn(3, 6, 9)
    exe = compile_interpret(model, (x,), ({1: SMALL},))
    x = torch.randn(3, 7, 9)
    assert_matches(exe(x), model(x), 1e-5)


def _with_config(exe, **params):
    """Run every reduction kernel at a different (small) config, to exercise tails."""
    for name, k in exe.program.kplan.kernels.items():
        if isinstance(k, TritonKernel) and k.spec.template == "reduction":
            cfg = dict(k.config.params)
            if not k.spec.meta["persistent"] or "RBLOCK" not in params:
                cfg.update(params)
            exe.program.set_kernel(name, TritonKernel(
                k.region, k.spec, Config.make(k.config.num_warps, 1, **cfg), interpret=True))


@pytest.mark.parametrize("dims", [(2,), (1,), (0, 2)])
def test_looped_rows_with_tails(dims):
    model = Reductions(dims, False)
    x = torch.randn(3, 6, 9)
    exe = compile_interpret(model, (x,), ({1: LARGE},))
    if 1 in dims:
        assert all(not k.spec.meta["persistent"] for k in triton_kernels(exe)
                   if k.spec.template == "reduction")
    _with_config(exe, XBLOCK=2, RBLOCK=4)  # several chunks per row, partial last chunk
    x = torch.randn(3, 11, 9)
    assert_matches(exe(x), model(x), 1e-5)


class Normalizations(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(12)
        self.ln2 = torch.nn.LayerNorm((4, 12), elementwise_affine=False)
        self.w = torch.nn.Parameter(torch.randn(12))

    def forward(self, x):
        h = x.float()
        rms = self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        m = x.amax(-1, keepdim=True)  # softmax by hand: two reductions sharing the row
        e = (x - m).exp()
        var, mean = torch.var_mean(x, -1, keepdim=True)
        return (rms, torch.softmax(x, -1), torch.log_softmax(x, -1), torch.softmax(x, 1),
                e / e.sum(-1, keepdim=True), self.ln(x), self.ln2(x), var, mean,
                torch.softmax(x.float(), -1).to(x.dtype))


@pytest.mark.parametrize("dim", [SMALL, LARGE], ids=["persistent", "looped"])
def test_normalizations(dim):
    model = Normalizations()
    x = torch.randn(2, 4, 12)
    exe = compile_interpret(model, (x,), ({0: dim},))
    if dim is LARGE:
        _with_config(exe, XBLOCK=2)
    x = torch.randn(3, 4, 12) * 3
    assert_matches(exe(x), model(x), 1e-5)


def test_looped_normalizations_across_chunks():
    class M(torch.nn.Module):
        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return (h, torch.softmax(x, -1), torch.log_softmax(x, -1), torch.logsumexp(x, -1),
                    F.layer_norm(x, (x.shape[-1],)), x.argmax(-1),
                    (torch.softmax(x, -1) * x).sum(-1))  # a reduction of a softmax

    x = torch.randn(3, 20)
    exe = compile_interpret(M(), (x,), ({1: LARGE},))
    _with_config(exe, XBLOCK=2, RBLOCK=8)
    x = torch.randn(3, 37)
    x[1, 3] = x[1, 30] = 9.0  # a tie: argmax returns the first
    assert_matches(exe(x), M()(x), 1e-5)
    x[0] = -float("inf")  # online softmax / logsumexp edge rows
    x[2, 5] = float("inf")
    ref = M()(x)
    assert_matches(exe(x)[1:4], ref[1:4], 1e-5)


def test_nan_and_ties_follow_torch():
    class M(torch.nn.Module):
        def forward(self, x):
            return x.amax(-1), x.argmax(-1), x.argmin(-1), x.max(-1).indices, x.sum(-1)

    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, float("nan"), 5.0, float("nan")],
                      [-float("inf")] * 4, [2.0, 2.0, 2.0, 2.0]])
    exe = compile_interpret(M(), (x,))
    assert_matches(exe(x), M()(x), 0.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_rows_accumulate_in_fp32(dtype):
    model = Normalizations().to(dtype)
    x = torch.randn(2, 4, 12).to(dtype)
    exe = compile_interpret(model, (x,), ({0: SMALL},))
    x = (torch.randn(3, 4, 12) * 3).to(dtype)
    assert_matches(exe(x), model(x), 1e-2)


def test_integer_and_bool_reductions():
    class M(torch.nn.Module):
        def forward(self, n, b):
            return n.sum(-1), n.amax(0), n.prod(-1), b.sum(-1), b.any(0), n.argmax(-1)

    n = torch.randint(-5, 5, (4, 6))
    b = torch.rand(4, 6) > 0.5
    exe = compile_interpret(M(), (n, b), ({0: SMALL}, {0: SMALL}))
    n, b = torch.randint(-5, 5, (7, 6)), torch.rand(7, 6) > 0.5
    assert_matches(exe(n, b), M()(n, b), 0.0)
