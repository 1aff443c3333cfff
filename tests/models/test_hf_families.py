"""Llama 3.1, Mistral, Qwen2 and Qwen3 checkpoints made by transformers, run by kiln, match it."""

import math

import pytest
import torch

from kiln.models.hf import config_from_hf
from kiln.models.llama import LlamaConfig, rope_inv_freq
from tests.helpers import rel_err
from tests.models.support import FAMILIES


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_logits_match_transformers(family, checkpoints, llms):
    _, hf_model = checkpoints[family]
    llm = llms(family)
    assert not any(p.is_meta for p in llm.model.parameters())
    vocab = llm.cfg.vocab_size
    tokens = torch.randint(3, vocab, (1, 20))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    prompt = 13
    out = [llm.forward(tokens[:, :prompt], torch.arange(prompt))]
    for p in range(prompt, tokens.shape[1]):  # decode steps, one token each
        out.append(llm.forward(tokens[:, p:p + 1], torch.tensor([p])))
    out = torch.cat(out, dim=1)
    assert out.shape == ref.shape
    for p in range(tokens.shape[1]):
        assert rel_err(out[:, p], ref[:, p]) <= 1e-4, (family, p, rel_err(out[:, p], ref[:, p]))


# (generator seed, length) of each family's random prompt: one whose greedy reference
# does not fall into a loop of a few tokens (qwen2's tied tiny model does from most).
GREEDY_PROMPTS = {"llama3.1": (0, 7), "mistral": (0, 7), "qwen2": (14, 11), "qwen3": (2, 11)}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_matches_transformers(family, checkpoints, llms):
    _, hf_model = checkpoints[family]
    llm = llms(family)
    seed, length = GREEDY_PROMPTS[family]
    prompt = torch.randint(3, llm.cfg.vocab_size, (length,),
                           generator=torch.Generator().manual_seed(seed)).tolist()
    ours = llm.generate(prompt, max_new_tokens=32, ignore_eos=True)
    ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32,
                            do_sample=False)[0, len(prompt):].tolist()
    assert len(set(ref)) >= 8, f"a reference of few distinct tokens tests little: {ref}"
    assert ours.ids == ref
    assert ours.finish_reason == "length"


def test_config_decides_the_variant(checkpoints, llms):
    llama, mistral, qwen = (llms(f).model for f in ("llama3.1", "mistral", "qwen2"))
    assert llama.cfg.rope_scaling["rope_type"] == "llama3"
    assert mistral.model.layers[0].self_attn.window == 6
    assert llama.model.layers[0].self_attn.window is None
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight  # tied
    assert qwen.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen.model.layers[0].self_attn.o_proj.bias is None
    assert llama.model.layers[0].self_attn.q_proj.bias is None


ROPE_CASES = {
    "llama3.1": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "llama3.1-short": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                       "high_freq_factor": 8.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "default": None,
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_frequencies_match_transformers(case):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = ROPE_CASES[case]
    hf_cfg = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32,
                                      rope_theta=500000.0, rope_scaling=scaling,
                                      max_position_embeddings=131072)
    hf_cfg.standardize_rope_params()
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    cfg = config_from_hf(hf_cfg.to_dict(), max_seq_len=64)
    ours = rope_inv_freq(cfg)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    if kind == "llama3":  # the three bands are all present: kept, blended, slowed
        base = rope_inv_freq(LlamaConfig(dim=4096, n_heads=32, rope_theta=500000.0))
        ratio = base / ours
        assert math.isclose(ratio[0].item(), 1.0)
        assert math.isclose(ratio[-1].item(), scaling["factor"], rel_tol=1e-6)
        assert ((ratio > 1.001) & (ratio < scaling["factor"] - 1e-3)).any()


VARIANTS = {  # (family, config overrides): mapped from config.json, checked eagerly
    "llama2": ("llama3.1", dict(rope_scaling=None, rope_theta=10000.0)),
    "llama-biases": ("llama3.1", dict(attention_bias=True, mlp_bias=True)),
    "llama-linear-rope": ("llama3.1", dict(rope_scaling={"rope_type": "linear",
                                                         "factor": 2.0})),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=5,
                                    max_window_layers=1)),
    "mistral-no-window": ("mistral", dict(sliding_window=None)),
    # dynamic NTK RoPE is the default one within max_position_embeddings; swish is SiLU
    "llama-dynamic-rope-swish": ("llama3.1", dict(rope_scaling={"rope_type": "dynamic",
                                                                "factor": 2.0},
                                                  hidden_act="swish")),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variants_match_transformers(variant, tmp_path):
    """Each config.json variant, mapped by kiln, gives transformers' logits (the module
    kiln compiles, run eagerly, through its KV cache)."""
    from kiln.models.hf import load_checkpoint
    from tests.models.support import make_checkpoint

    family, overrides = VARIANTS[variant]
    hf_model = make_checkpoint(tmp_path, family, **overrides)
    model, _ = load_checkpoint(tmp_path)
    model.setup_cache()
    tokens = torch.randint(3, model.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        out = torch.cat([model(tokens[:, :9], torch.arange(9)),
                         *(model(tokens[:, p:p + 1], torch.tensor([p])) for p in range(9, 16))],
                        dim=1)
    assert rel_err(out, ref) <= 1e-4, rel_err(out, ref)
    if variant == "qwen2-sliding":
        assert [layer.self_attn.window for layer in model.model.layers] == [None, 5]
