"""Generated pointwise / reduction / copy kernels on a CUDA GPU vs eager, at sizes where
the kernels' tiling, vectorisation and looping matter (run by the lead on the GPU)."""

import copy

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.models.llama import example_inputs, tiny_llama
from tests.codegen.gen_helpers import GENERATED, assert_matches
from tests.codegen.test_copy_kernels import Cache
from tests.codegen.test_pointwise_kernels import FloatMath, HalfChain
from tests.codegen.test_reduction_kernels import Reductions
from tests.helpers import assert_lowp_close, rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
SEQ = torch.export.Dim("T", min=1, max=8192)


def compile_cuda(model, args, dynamic_shapes=None):
    exe = kiln.compile(model, args, dynamic_shapes=dynamic_shapes, target="cuda")
    for r in exe.plan.regions:
        if r.kind in GENERATED:
            assert isinstance(exe.program.kplan.kernels[r.name], TritonKernel), (r.name, r.notes)
    return exe


def cuda(*xs):
    return tuple(x.cuda() for x in xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pointwise_chains(dtype):
    x, y, z = cuda(*(torch.randn(4, 1000, 1024).to(dtype) for _ in range(3)))
    dyn = ({1: SEQ},) * 3
    exe = compile_cuda(HalfChain(), (x, y, z), dyn)
    x, y, z = cuda(*(torch.randn(4, 1531, 1024).to(dtype) for _ in range(3)))
    assert_matches(exe(x, y, z), HalfChain()(x, y, z), TOL[dtype])


def test_float_math_libdevice_forms():
    x, y = cuda(torch.randn(3, 999, 33), torch.randn(33))
    exe = compile_cuda(FloatMath(), (x, y), ({1: SEQ}, None))
    assert_matches(exe(x, y), FloatMath()(x, y), 1e-5)


@pytest.mark.parametrize("dims,keepdim", [((2,), False), ((1,), True), ((0,), False),
                                          ((0, 2), False), ((0, 1, 2), False)])
def test_reductions_large(dims, keepdim):
    model = Reductions(dims, keepdim)
    x = cuda(torch.randn(16, 2000, 300))[0]
    exe = compile_cuda(model, (x,), ({1: SEQ},))
    x = cuda(torch.randn(16, 3001, 300) * 0.02)[0]  # small: long products stay finite
    assert_matches(exe(x), model(x), 1e-5)


class Norms(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(hidden))
        self.b = torch.nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        h = x.float()
        rms = self.w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
        return (rms, torch.softmax(x, -1), torch.log_softmax(x.float(), -1),
                F.layer_norm(x, (x.shape[-1],), self.w.to(x.dtype), self.b.to(x.dtype)),
                x.argmax(-1))


@pytest.mark.parametrize("hidden", [4096, 5000, 32000, 128256],
                         ids=["4096", "odd", "vocab32k-looped", "vocab128k-looped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_row_normalizations(hidden, dtype):
    model = Norms(hidden).cuda().to(dtype)
    rows = max(8, (1 << 24) // hidden)
    x = cuda(torch.randn(rows, hidden).to(dtype) * 2)[0]
    exe = compile_cuda(model, (x,), ({0: SEQ},))
    x = cuda(torch.randn(rows + 3, hidden).to(dtype) * 2)[0]
    out, ref = exe(x), model(x)
    assert_matches(out[:4], ref[:4], TOL[dtype])
    # argmax on low-precision rows can tie: compare the values it points at
    assert torch.equal(x.gather(1, out[4][:, None]), x.gather(1, ref[4][:, None]))


class NanRows(torch.nn.Module):
    def forward(self, x):
        return x.amax(-1), x.amin(-1), torch.softmax(x, -1), x.argmax(-1), x.amax(0)


@pytest.mark.parametrize("hidden", [1000, 32000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_min_propagate_nan_like_torch(hidden, dtype):
    """max / min reduce with PTX's NaN-propagating max (max.NaN): a NaN anywhere in a
    row (or column) makes it NaN, in the persistent, looped and column forms."""
    x = torch.randn(64, hidden).to(dtype)
    exe = compile_cuda(NanRows(), cuda(x), ({0: SEQ},))
    x = torch.randn(67, hidden).to(dtype)
    x[3, hidden // 2] = float("nan")
    x[5, -1] = float("nan")
    x[7] = -float("inf")
    x[9, 0] = float("inf")
    x[11, :7] = float("nan")
    out, ref = exe(*cuda(x)), NanRows()(x)
    for o, r in zip(out, ref):
        o = o.cpu()
        assert torch.equal(o.isnan(), r.isnan()), (hidden, dtype)
        ok = ~r.isnan()
        if r.is_floating_point():
            assert_matches(o[ok], r[ok], TOL[dtype])
        else:
            assert torch.equal(o[ok], r[ok])


def test_kv_cache_scatter_in_place():
    model = Cache().cuda()
    eager = copy.deepcopy(model)
    T = torch.export.Dim("T", min=1, max=16)
    args = cuda(torch.randn(1, 3, 8), torch.arange(3), torch.randn(3, 4))
    exe = compile_cuda(model, args, ({1: T}, {0: T}, {0: T}))
    start = 0
    for n in (3, 1, 1):
        x, pos, cos = cuda(torch.randn(1, n, 8), torch.arange(start, start + n), torch.randn(n, 4))
        assert_matches(exe(x, pos, cos), eager(x, pos, cos), 1e-6)
        start += n
    for a, b in zip(model.buffers(), eager.buffers()):
        assert rel_err(a, b) <= 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_tiny_llama_on_cuda(dtype, tol):
    model = tiny_llama(dtype=dtype).cuda()
    eager = copy.deepcopy(model)
    exact = copy.deepcopy(model).float()
    exact.setup_cache(torch.float32)
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    exe = compile_cuda(model, cuda(*args), dynamic)
    pos = 0
    for n in (9, 1, 1):
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), device="cuda")
        input_pos = torch.arange(pos, pos + n, device="cuda")
        out, ref = exe(tokens, input_pos), eager(tokens, input_pos)
        if dtype == torch.float32:
            assert rel_err(out, ref) <= tol
        else:
            assert_lowp_close(out, ref, exact(tokens, input_pos), tol)
        pos += n
