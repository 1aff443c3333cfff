"""The thirty-third session's decode folds and the eager-attention rewrite on a GPU
target against eager: a LayerNorm folded into the GEMVs that read it (one, three
grouped, GPT-2's Conv1D MLP), a query's per-head norm sum folded into decode attention
(Qwen3's q/k norm, head dim 128), attention written out run as kiln's attention kernel.
fp32 1e-5, fp16/bf16 1e-2."""

from __future__ import annotations

import pytest
import torch

import kiln
from tests.codegen.test_matmul_layernorm import LNQKV, GPT2Block, LNLinear, _layer_norm_kernels
from tests.dispatch.test_fold_query_norm import QKNormAttention, _folded
from tests.graph.test_eager_attention import HFEagerAttention, NanoGPTAttention
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])


def _check(model, exe, cases, dtype):
    with torch.no_grad():
        for args in cases:
            got, ref = exe(*args), model(*args)
            for g, r in zip(got if isinstance(got, tuple) else (got,),
                            ref if isinstance(ref, tuple) else (ref,)):
                assert rel_err(g, r) <= TOL[dtype], rel_err(g, r)


@DTYPES
@pytest.mark.parametrize("make,dim,args", [
    (lambda: LNLinear(2048, 768), 2048, 1),
    (lambda: LNQKV(1024, 256), 1024, 1),
    (lambda: GPT2Block(1024), 1024, 2)])
def test_layer_norm_folded_into_decode_gemvs(make, dim, args, dtype):
    """A residual stream far from zero mean: the centring carries most of the product."""
    torch.manual_seed(0)
    model = make().to(dtype).cuda().eval()

    def case():
        return tuple((3 * torch.randn(1, 1, dim) + 5).to(dtype).cuda() for _ in range(args))

    exe = kiln.compile(model, case(), target="cuda")
    assert _layer_norm_kernels(exe)
    _check(model, exe, [case(), case()], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_query_norm_sum_folded_into_decode_attention(dtype):
    torch.manual_seed(0)
    kw = dict(dim=256, heads=8, kv=2, hd=128, cache=64)
    model = QKNormAttention(**kw).to(dtype).cuda().eval()
    twin = QKNormAttention(**kw).to(dtype).cuda().eval()
    twin.load_state_dict(model.state_dict())
    x, pos = torch.randn(1, 1, 256, dtype=dtype, device="cuda"), torch.tensor([0], device="cuda")
    exe = kiln.compile(model, (x, pos), target="cuda")
    assert _folded(exe.plan)
    with torch.no_grad():
        for p in range(0, 40, 3):
            x = 3 * torch.randn(1, 1, 256, dtype=dtype, device="cuda")
            pos = torch.tensor([p], device="cuda")
            got, ref = exe(x, pos), twin(x, pos)
            assert rel_err(got, ref) <= TOL[dtype], (p, rel_err(got, ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_written_out_runs_as_the_attention_kernel(dtype):
    torch.manual_seed(0)
    nano = NanoGPTAttention(dim=256, heads=4, block=128).to(dtype).cuda().eval()
    t = torch.export.Dim("T", min=2, max=127)
    exe = kiln.compile(nano, (torch.randn(1, 16, 256, dtype=dtype, device="cuda"),),
                       target="cuda", dynamic_shapes=({1: t},))
    _check(nano, exe, [(torch.randn(1, n, 256, dtype=dtype, device="cuda"),)
                       for n in (2, 33, 127)], dtype)
    hf = HFEagerAttention(dim=512, heads=8, kv=2).to(dtype).cuda().eval()
    x = torch.randn(2, 40, 512, dtype=dtype, device="cuda")
    exe = kiln.compile(hf, (x,), target="cuda")
    _check(hf, exe, [(x,), (3 * torch.randn(2, 40, 512, dtype=dtype, device="cuda"),)], dtype)
