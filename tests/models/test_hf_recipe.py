"""Checkpoints of causal LMs kiln has no model for load through transformers' static-cache
recipe (kiln.models.hf_recipe): generation matches transformers' own, the compiled LLM
saves and loads, and what the recipe cannot do is refused before anything compiles."""

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kiln.models  # noqa: E402
from kiln.errors import ArgumentError, CheckpointError  # noqa: E402

PROMPT = [5, 9, 17, 33, 4, 8, 61]


def _gemma(path):
    """A tiny random Gemma (RMSNorm of 1 + w, GELU, a scaled embedding: no kiln model)
    saved as a checkpoint directory; weights spread so the logits are not near zero."""
    cfg = transformers.GemmaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.GemmaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma")
    return path, _gemma(path)


def test_a_model_kiln_does_not_know_generates_as_transformers_does(gemma, tmp_path):
    path, ref = gemma
    llm = kiln.models.load(path, max_seq_len=32)
    ids = torch.tensor([PROMPT])
    logits = llm.forward(ids, torch.arange(len(PROMPT)))
    with torch.no_grad():
        want = ref(ids).logits
    assert ((logits - want).norm() / want.norm()).item() < 1e-5
    assert llm.model.head_at_rows is not None  # the prefill projects only the rows asked
    last = llm.forward(ids, torch.arange(len(PROMPT)), logits_at=torch.tensor([[6, 2]]))
    assert last.shape == (1, 2, 128)
    assert ((last - want[:, [6, 2]]).norm() / want[:, [6, 2]].norm()).item() < 1e-5
    got = llm.generate([PROMPT], max_new_tokens=8)[0].ids
    expect = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got == expect[0, len(PROMPT):].tolist()
    llm.save(tmp_path / "gemma.kiln")  # and back, without compiling
    again = kiln.models.load(tmp_path / "gemma.kiln")
    assert again.generate([PROMPT], max_new_tokens=8)[0].ids == got


def test_a_multimodal_checkpoint_generates_text_as_transformers_does(tmp_path):
    """Gemma 3 as published (Gemma3ForConditionalGeneration: vocabulary and context in
    text_config, a vision tower beside): text in, text out, transformers' greedy tokens.
    It had been refused ("vocab_size None is not a positive int")."""
    text = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
        vocab_size=300, max_position_embeddings=64)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2,
                                             image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    mm_tokens_per_image=4, image_token_index=299,
                                    boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    ref = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    ref.save_pretrained(tmp_path)
    llm = kiln.models.load(tmp_path, max_seq_len=32)
    assert llm.model.cfg.vocab_size == 300 and llm.model.cfg.max_seq_len == 32
    ids = torch.tensor([PROMPT])
    got = llm.generate([PROMPT], max_new_tokens=8)[0].ids  # past the 4-token window
    expect = ref.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got == expect[0, len(PROMPT):].tolist()


def test_longrope_switching_past_its_original_context_generates_as_transformers(tmp_path):
    """Phi-3.5 / Phi-4-mini's longrope: transformers writes the rotary buffer from the
    positions each call (short factors, then long ones past the original context) and
    advances the cache's counters through aliases; the prompt and decode modules had
    failed inside torch's re-trace ("expected compiled_fn to be GraphModule").
    transformers' generate recomputes the whole cache once at the switch (position 16
    here), and so does LLM.generate: greedy tokens as generate's across it (without the
    second prefill the last two differ)."""
    cfg = transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
        original_max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8})
    torch.manual_seed(0)
    ref = transformers.Phi3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path)
    llm = kiln.models.load(tmp_path, max_seq_len=32)
    assert llm.cfg.refill_at == 16
    llm.save(tmp_path / "phi.kiln")  # the saved LLM prefills again there too
    again = kiln.models.load(tmp_path / "phi.kiln")
    for prompt in (PROMPT, list(range(3, 19))):  # 7 tokens; 16, the switch's own step
        got = llm.generate([prompt], max_new_tokens=12)[0].ids
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False)[0, len(prompt):].tolist()
        assert got == hf, prompt
        assert again.generate([prompt], max_new_tokens=12)[0].ids == hf, prompt


@pytest.mark.parametrize("kw,named", [
    ({"max_batch_size": 2}, "one sequence at a time"),
    ({"paged": True}, "contiguous cache"),
    ({"quantize": "fp8"}, "quantize='fp8'"),
    ({"tensor_parallel_size": 2}, "one device"),
])
def test_what_the_recipe_cannot_do_is_refused(gemma, kw, named):
    with pytest.raises(ArgumentError, match=named):
        kiln.models.load(gemma[0], max_seq_len=32, **kw)


def test_a_config_without_architectures_loads_by_its_model_type(gemma):
    from kiln.models.hf_recipe import config_from_hf

    cfg = json.loads((gemma[0] / "config.json").read_text())
    del cfg["architectures"]
    assert config_from_hf(cfg).architecture == "GemmaForCausalLM"
    cfg["model_type"] = "no_such_model"
    with pytest.raises(CheckpointError, match="'no_such_model' is neither"):
        config_from_hf(cfg)


@pytest.mark.parametrize("edit,named", [
    ({"architectures": ["FooForCausalLM"]}, "neither a kiln model nor a transformers"),
    ({"architectures": ["GemmaModel"]}, "neither a kiln model nor a transformers"),
    ({"quantization_config": {"quant_method": "awq"}}, "quantized GemmaForCausalLM"),
    ({"vocab_size": "many"}, "vocab_size"),
])
def test_configs_the_recipe_cannot_load_say_why(gemma, tmp_path, edit, named):
    cfg = json.loads((gemma[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(CheckpointError, match=named):
        kiln.models.load(tmp_path, random_weights=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_kiln_does_not_know_generates_on_cuda_with_graphs(gemma, dtype):
    """The recipe's modules on kiln's generated kernels, decode replayed as CUDA graphs:
    greedy tokens as transformers' on the same device (fp32; bf16: the prefill's logits
    within bf16 rounding of transformers' own bf16 run)."""
    path, ref = gemma
    llm = kiln.models.load(path, max_seq_len=32, target="cuda", dtype=dtype)
    assert llm.cuda_graphs
    model = copy.deepcopy(ref).to("cuda", dtype)
    ids = torch.tensor([PROMPT], device="cuda")
    with torch.no_grad():
        want = model(ids).logits.float()
    logits = llm.forward(ids, torch.arange(len(PROMPT), device="cuda")).float()
    assert ((logits - want).norm() / want.norm()).item() < (1e-5 if dtype == torch.float32
                                                           else 2e-2)
    if dtype == torch.float32:
        got = llm.generate([PROMPT], max_new_tokens=8)[0].ids
        expect = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert got == expect[0, len(PROMPT):].tolist()
