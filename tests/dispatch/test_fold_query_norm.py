"""A decode query's per-head norm statistics folded into the attention
(kiln.dispatch.fold_query_norm): which plans fold, and the attention kernel's numerics
under Triton's interpreter against eager (fp32 1e-5, fp16 1e-2), RoPE after the norm,
a padded head dim."""

import pytest
import torch

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class QKNormAttention(torch.nn.Module):
    """Qwen3's attention: q and k normalised per head (RMSNorm over the head dim), then
    RoPE, keys and values written to a static cache, GQA. `whole`: OLMo 2's norm over
    all heads at once instead."""

    def __init__(self, dim=64, heads=4, kv=2, hd=16, cache=12, whole=False):
        super().__init__()
        self.h, self.kv, self.hd, self.whole = heads, kv, hd, whole
        self.q = torch.nn.Linear(dim, heads * hd, bias=False)
        self.k = torch.nn.Linear(dim, kv * hd, bias=False)
        self.v = torch.nn.Linear(dim, kv * hd, bias=False)
        self.q_norm = torch.nn.Parameter(1 + 0.2 * torch.randn(heads * hd if whole else hd))
        self.k_norm = torch.nn.Parameter(1 + 0.2 * torch.randn(kv * hd if whole else hd))
        self.register_buffer("k_cache", torch.zeros(1, kv, cache, hd))
        self.register_buffer("v_cache", torch.zeros(1, kv, cache, hd))
        angles = torch.arange(cache)[:, None] * 0.3 ** torch.arange(hd // 2)[None, :]
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    @staticmethod
    def _norm(x, w):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return w * h.to(x.dtype)

    def _heads(self, x, proj, n, w):
        B, T, _ = x.shape
        y = proj(x)
        if self.whole:
            return self._norm(y, w).view(B, T, n, self.hd).transpose(1, 2)
        return self._norm(y.view(B, T, n, self.hd), w).transpose(1, 2)

    def forward(self, x, pos):
        B, T, _ = x.shape
        cos, sin = self.cos[pos].to(x.dtype), self.sin[pos].to(x.dtype)
        q = self._heads(x, self.q, self.h, self.q_norm)
        k = self._heads(x, self.k, self.kv, self.k_norm)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        v = self.v(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        mask = torch.arange(self.k_cache.shape[2], device=x.device)[None, :] <= pos[:, None]
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True)


def _folded(plan):
    return [r for r in plan.regions if r.kind == RegionKind.ATTENTION
            and any("head-dim sum" in n for n in r.notes)]


def _reductions(plan):
    # the mask envelope's region (dispatch/mask_envelope) is not a norm's
    return [r for r in plan.regions if r.kind == RegionKind.REDUCTION
            and not (set(r.outputs) & {v for x in plan.regions for v in x.key_bounds or ()})]


def _models(dtype, **kw):
    torch.manual_seed(0)
    model = QKNormAttention(**kw).to(dtype).eval()
    twin = QKNormAttention(**kw).to(dtype).eval()
    twin.load_state_dict(model.state_dict())  # eager's own cache, written alike
    return model, twin


@pytest.mark.parametrize("dtype,hd", [(torch.float32, 16), (torch.float32, 24),
                                      (torch.float16, 16)])
def test_query_norm_sum_runs_in_the_attention(dtype, hd):
    """Over decode steps: q's sum folded (k's stays: its reader is the cache write), the
    attention a generated kernel; hd 24 pads the head dim to 32 lanes."""
    model, twin = _models(dtype, hd=hd)
    x, pos = torch.randn(1, 1, 64, dtype=dtype), torch.tensor([3])
    exe = kiln.compile(model, (x, pos), target="interpret")
    (attn,) = _folded(exe.plan)
    assert isinstance(exe.program.kplan.kernels[attn.name], TritonKernel)
    assert len(_reductions(exe.plan)) == 1  # the key's
    with torch.no_grad():
        for p in (3, 4, 7):
            x, pos = 3 * torch.randn(1, 1, 64, dtype=dtype), torch.tensor([p])
            got, ref = exe(x, pos), twin(x, pos)
            assert rel_err(got, ref) <= TOL[dtype], rel_err(got, ref)


def test_norm_over_all_heads_prefill_and_cpu_do_not_fold():
    """OLMo 2's norm spans every head (the tile holds one); a prompt's attention is not
    a decode one; the CPU target runs torch ops."""
    x, pos = torch.randn(1, 1, 64), torch.tensor([3])
    whole = kiln.compile(_models(torch.float32, whole=True)[0], (x, pos),
                         target="interpret", compile_to="dispatch")
    prompt = kiln.compile(_models(torch.float32)[0], (torch.randn(1, 4, 64), torch.arange(4)),
                          target="interpret", compile_to="dispatch")
    cpu = kiln.compile(_models(torch.float32)[0], (x, pos), target="cpu",
                       compile_to="dispatch")
    for plan in (whole, prompt, cpu):
        assert not _folded(plan) and len(_reductions(plan)) == 2


def test_a_declined_fold_runs_the_query_prologue_apart(monkeypatch):
    """Should the attention template decline the folded sum, the query's prologue
    (norm, RoPE) becomes a region again and the attention keeps its kernel."""
    from kiln.codegen import select_kernels
    from kiln.codegen.expr.values import CodegenUnsupported

    real = select_kernels.TEMPLATES[RegionKind.ATTENTION]

    def declines_folded(region, plan, target):
        if any("head-dim sum" in n for n in region.notes) and any(
                o.target == "aten.mean.dim" for o in region.ops):
            raise CodegenUnsupported("a test's refusal")
        return real(region, plan, target)

    monkeypatch.setitem(select_kernels.TEMPLATES, RegionKind.ATTENTION, declines_folded)
    model, twin = _models(torch.float32)
    x, pos = torch.randn(1, 1, 64), torch.tensor([3])
    exe = kiln.compile(model, (x, pos), target="interpret")
    (attn,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert isinstance(exe.program.kplan.kernels[attn.name], TritonKernel)
    assert not any(o.target == "aten.mean.dim" for o in attn.ops)
    with torch.no_grad():
        assert rel_err(exe(x, pos), twin(x, pos)) <= 1e-5
