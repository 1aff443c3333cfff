"""Soft-capped attention (kiln.ops.softcap_attention, written out as Gemma 2 writes it,
rewritten by kiln.graph.eager_attention): the chains that become the op, and kiln's
attention kernel computing the cap under Triton's interpreter against eager (fp32 1e-5,
fp16 1e-2): prompts and decode over a cache, GQA written out, additive and boolean
masks, a sliding window, scores far past the cap; transformers' Gemma 2; the CPU
target."""

import pytest
import torch

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
SOFTCAP = "kiln.softcap_attention.default"


class Gemma2Attention(torch.nn.Module):
    """transformers' Gemma 2 eager attention: repeat_kv, scores times the scaling, then
    / cap, tanh, * cap, the additive mask (causal, or a sliding window of `window`), an
    fp32 softmax cast back. `boolean`: a masked_fill of -inf after the cap instead."""

    def __init__(self, heads=4, kv=2, hd=16, cap=5.0, window=None, boolean=False):
        super().__init__()
        self.heads, self.kv, self.hd, self.cap = heads, kv, hd, cap
        self.window, self.boolean = window, boolean

    def forward(self, q, k, v, pos):
        B, _, T, _ = q.shape
        S = k.shape[2]
        rep = self.heads // self.kv
        k, v = (t[:, :, None].expand(B, self.kv, rep, S, self.hd).reshape(B, self.heads, S,
                                                                          self.hd)
                for t in (k, v))
        keys = torch.arange(S, device=q.device)
        ok = keys[None, :] <= pos[:, None]
        if self.window is not None:
            ok = ok & (keys[None, :] > pos[:, None] - self.window)
        w = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5
        w = torch.tanh(w / self.cap) * self.cap
        if self.boolean:
            w = w.masked_fill(~ok, float("-inf"))
        else:
            w = w + torch.where(ok, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, v)


def _inputs(T, S, dtype, heads=4, kv=2, hd=16, spread=6.0):
    """q and k large enough that most scores pass the cap (a cap that did nothing would
    pass an uncapped kernel); positions of the queries' last T of S keys."""
    q = spread * torch.randn(1, heads, T, hd, dtype=dtype)
    k, v = spread * torch.randn(1, kv, S, hd, dtype=dtype), torch.randn(1, kv, S, hd, dtype=dtype)
    return q, k, v, torch.arange(S - T, S)


def _attention_regions(exe):
    regions = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert all(any(o.target == SOFTCAP for o in r.ops) for r in regions)
    return regions


def _check(model, exe, cases, dtype):
    with torch.no_grad():
        for args in cases:
            got, ref = exe(*args), model(*args)
            assert rel_err(got, ref) <= TOL[dtype], rel_err(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", [{}, {"window": 3}, {"boolean": True}])
def test_capped_prompt_and_decode_run_the_attention_kernel(dtype, form):
    model = Gemma2Attention(**form).eval()
    for T, S in ((7, 7), (1, 21)):  # a prompt; decode over a cache (split keys)
        args = _inputs(T, S, dtype)
        exe = kiln.compile(model, args, target="interpret")
        (region,) = _attention_regions(exe)
        assert isinstance(exe.program.kplan.kernels[region.name], TritonKernel)
        assert not [o for r in exe.plan.regions for o in r.ops
                    if o.target in ("aten.bmm.default", "aten._softmax.default")]
        _check(model, exe, [args, _inputs(T, S, dtype)], dtype)


def test_the_cap_changes_the_answer():
    """The inputs drive most scores past the cap: with it lifted, the output moves far
    more than any tolerance here."""
    args = _inputs(5, 5, torch.float32)
    with torch.no_grad():
        capped, loose = Gemma2Attention(cap=5.0)(*args), Gemma2Attention(cap=1e4)(*args)
    assert rel_err(capped, loose) > 0.1


def test_a_prompt_of_any_length():
    model = Gemma2Attention().eval()
    t = torch.export.Dim("T", min=2, max=32)
    q, k, v, pos = _inputs(8, 8, torch.float32)
    exe = kiln.compile(model, (q, k, v, pos), target="interpret",
                       dynamic_shapes=({2: t}, {2: t}, {2: t}, {0: t}))
    _attention_regions(exe)
    _check(model, exe, [_inputs(n, n, torch.float32) for n in (3, 17)], torch.float32)


def test_the_cpu_target_runs_the_ops_own_form_and_round_trips(tmp_path):
    model = Gemma2Attention(window=4).eval()
    args = _inputs(6, 6, torch.float32)
    exe = kiln.compile(model, args, target="cpu")
    _attention_regions(exe)
    exe.save(tmp_path / "capped.kiln")
    _check(model, kiln.load(tmp_path / "capped.kiln"), [args, _inputs(6, 6, torch.float32)],
           torch.float32)


def test_transformers_gemma2_logits():
    """transformers' Gemma 2 (eager attention, a sliding layer and a global one, the
    final logit cap too) through the interpret target: every attention is the op."""
    import transformers

    cfg = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        attn_logit_softcapping=5.0, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 9))
    exe = kiln.compile(model, (ids,), {"use_cache": False}, target="interpret")
    assert len(_attention_regions(exe)) == 2
    with torch.no_grad():
        got = exe(ids, use_cache=False).logits
        ref = model(ids, use_cache=False).logits
    assert rel_err(got, ref) <= 1e-5, rel_err(got, ref)
