"""Prefill attention on a GPU target against eager: the thirty-fifth session's split of
the key's prologue (dispatch/split_attention_prologues.py: Qwen3's attention without a
cache, q and k normalised then RoPE'd in regions before it, head dim 128) and
transformers' prompt mask run as is_causal (graph/causal_sdpa.py: Llama with sdpa and
eager attention); the thirty-fourth's soft-capped attention op (transformers' Gemma 2:
a tanh cap on the scores, head dim 256, a sliding layer and a global one); the
thirty-sixth's gathered causal rows as a prefix mask (graph/tril_rows.py,
dispatch/prefix_mask.py: gpt-fast's attention over a static cache, no mask loops).
Dynamic prompt lengths; fp16/bf16 1e-2."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.ir.plan import RegionKind
from tests.codegen.test_softcap_attention import SOFTCAP
from tests.dispatch.test_split_attention_prologues import QKNormNoCache
from tests.helpers import rel_err

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_key_rope_apart_matches_eager(dtype):
    torch.manual_seed(0)
    model = QKNormNoCache(dim=256, heads=8, kv=2, hd=128, max_len=1024).to(dtype).cuda().eval()
    T = torch.export.Dim("T", min=2, max=1024)
    x = torch.randn(1, 64, 256, dtype=dtype, device="cuda")
    exe = kiln.compile(model, (x,), dynamic_shapes=({1: T},), target="cuda")
    (attn,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert any(r.name == f"{attn.name}_key" for r in exe.plan.regions)
    assert exe.program.kplan.kernels[attn.name].kind == "triton"
    with torch.no_grad():
        for t in (3, 100, 700):
            x = torch.randn(1, t, 256, dtype=dtype, device="cuda")
            assert rel_err(exe(x), model(x)) <= 1e-2, (t, rel_err(exe(x), model(x)))


def test_transformers_gemma2_prefill_with_the_cap():
    import transformers

    cfg = transformers.Gemma2Config(
        vocab_size=256, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=256, sliding_window=64,
        attn_logit_softcapping=50.0, max_position_embeddings=1024)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    T = kiln.Dim("T", min=2, max=512)
    ids = torch.randint(0, 256, (1, 40), device="cuda")
    exe = kiln.compile(model, (), {"input_ids": ids, "use_cache": False},
                       dynamic_shapes={"input_ids": {1: T}, "use_cache": None}, target="cuda")
    attns = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert len(attns) == 2 and all(any(o.target == SOFTCAP for o in r.ops) for r in attns)
    assert all(exe.program.kplan.kernels[r.name].kind == "triton" for r in attns)
    with torch.no_grad():
        for t in (17, 200, 500):
            ids = torch.randint(0, 256, (1, t), device="cuda")
            got = exe(input_ids=ids, use_cache=False).logits
            ref = model(input_ids=ids, use_cache=False).logits
            assert rel_err(got, ref) <= 1e-2, (t, rel_err(got, ref))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_transformers_llama_prompt_mask_runs_causal(attn):
    """transformers' prompt mask without a cache (causal and packed-sequence ids over
    aranges) as is_causal (graph/causal_sdpa.py): no mask envelope; logits as eager."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=1024)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
    T = kiln.Dim("T", min=2, max=1024)
    ids = torch.randint(0, 256, (1, 40), device="cuda")
    exe = kiln.compile(model, (), {"input_ids": ids, "use_cache": False},
                       dynamic_shapes={"input_ids": {1: T}, "use_cache": None}, target="cuda")
    attns = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert len(attns) == 2 and not any(r.key_bounds for r in attns)
    with torch.no_grad():
        for t in (17, 300, 1000):
            ids = torch.randint(0, 256, (1, t), device="cuda")
            got = exe(input_ids=ids, use_cache=False).logits
            ref = model(input_ids=ids, use_cache=False).logits
            assert rel_err(got, ref) <= 1e-2, (t, rel_err(got, ref))


class GatheredRows(torch.nn.Module):
    """gpt-fast's (kiln bench's) attention: mask rows gathered from a causal buffer by
    the positions, SDPA over a whole static cache (graph/tril_rows.py rewrites the
    gather; dispatch/prefix_mask.py then compiles the kernel without mask loops)."""

    def __init__(self, s: int):
        super().__init__()
        self.register_buffer("causal", torch.tril(torch.ones(s, s, dtype=torch.bool)))

    def forward(self, q, k_cache, v_cache, input_pos):
        mask = self.causal[None, None, input_pos]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k_cache, v_cache, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gathered_causal_rows_run_as_a_prefix_mask(dtype):
    torch.manual_seed(0)
    S = 1024
    model = GatheredRows(S).cuda()
    T = torch.export.Dim("T", min=1, max=S)
    cache = lambda: torch.randn(1, 8, S, 128, dtype=dtype, device="cuda")  # noqa: E731
    ex = (torch.randn(1, 32, 16, 128, dtype=dtype, device="cuda"), cache(), cache(),
          torch.arange(16, device="cuda"))
    exe = kiln.compile(model, ex, dynamic_shapes=({2: T}, None, None, {0: T}), target="cuda")
    (attn,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert attn.key_bounds and attn.key_bounds[2] is None
    assert "if not plain" not in exe.program.kplan.kernels[attn.name].spec.source
    with torch.no_grad():
        for start, t in ((0, 700), (300, 129), (900, 1)):
            args = (torch.randn(1, 32, t, 128, dtype=dtype, device="cuda"), cache(), cache(),
                    torch.arange(start, start + t, device="cuda"))
            assert rel_err(exe(*args), model(*args)) <= 1e-2, (start, t)
