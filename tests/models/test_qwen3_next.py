"""Qwen3-Next checkpoints made by transformers (random tiny weights), run by kiln, match it:
prefill and decode logits, greedy generation, and a batch of prompts of different
lengths (right padding must not advance the linear layers' state)."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ArgumentError, CheckpointError
from kiln.models.hf import config_from_hf, read_json
from kiln.models.qwen3_next import Qwen3NextConfig
from tests.helpers import rel_err

VOCAB = 128
# Layer 0: gated delta rule + MoE; layer 1: gated full attention + dense MLP.
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              layer_types=["linear_attention", "full_attention"], mlp_only_layers=[1],
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, max_position_embeddings=128,
              initializer_range=0.1, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(checkpoint dir, the transformers model saved there)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3_next")
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**CONFIG)).eval()
    with torch.no_grad():  # HF starts norms at their identity: make them count too
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.1)  # the gated norm scales by its weight
            elif "norm" in name:
                p.normal_(0.0, 0.1)  # the others by 1 + weight
    model.save_pretrained(str(path))
    model.generation_config.eos_token_id = None
    return path, model


@pytest.fixture(scope="module")
def llm(checkpoint):
    import kiln.models

    return kiln.models.load(checkpoint[0], max_batch_size=2, dtype=torch.float32)


def test_prefill_and_decode_logits_match_transformers(checkpoint, llm):
    _, hf_model = checkpoint
    tokens = torch.randint(0, VOCAB, (1, 21))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    prompt = 13
    out = [llm.forward(tokens[:, :prompt], torch.arange(prompt))]
    for p in range(prompt, tokens.shape[1]):
        out.append(llm.forward(tokens[:, p:p + 1], torch.tensor([p])))
    out = torch.cat(out, dim=1)
    assert out.shape == ref.shape
    for p in range(tokens.shape[1]):
        assert rel_err(out[:, p], ref[:, p]) <= 1e-4, (p, rel_err(out[:, p], ref[:, p]))


def test_interpret_target_runs_the_generated_gated_delta_kernel(checkpoint):
    """On a Triton target the op is kiln's own kernel (templates/gated_delta), read
    through the model's views of its projections, in prefill and in decode."""
    import kiln.models
    from kiln.codegen.build.triton_kernel import TritonKernel

    path, hf_model = checkpoint
    llm = kiln.models.load(path, dtype=torch.float32, target="interpret", max_seq_len=32)
    for exe in (llm.prefill_module, llm.decode_module):
        kernels = [exe.program.kplan.kernels[r.name] for r in exe.program.plan.regions
                   if any(op.target == "kiln.gated_delta_rule.default" for op in r.ops)]
        assert kernels and all(isinstance(k, TritonKernel) for k in kernels)
    tokens = torch.randint(0, VOCAB, (1, 19))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    out = [llm.forward(tokens[:, :17], torch.arange(17))]  # two chunks of 16, a tail of 1
    out += [llm.forward(tokens[:, p:p + 1], torch.tensor([p])) for p in (17, 18)]
    out = torch.cat(out, dim=1)
    assert rel_err(out, ref) <= 1e-4, rel_err(out, ref)


def test_greedy_generation_matches_transformers(checkpoint, llm):
    _, hf_model = checkpoint
    prompt = torch.randint(3, VOCAB, (7,)).tolist()
    ours = llm.generate(prompt, max_new_tokens=20, ignore_eos=True)
    ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)
    ref = ref[0, len(prompt):].tolist()
    assert len(set(ref)) >= 8, ref  # a run that says something, not one repeated token
    assert ours.ids == ref


def test_saved_llm_generates_the_same_tokens(checkpoint, llm, tmp_path):
    """The linear-attention state (and seq_lens in prefill) survive a save and a load."""
    import kiln.models

    llm.save(tmp_path / "qwen3next.kiln")
    loaded = kiln.models.load(tmp_path / "qwen3next.kiln")
    assert loaded.needs_seq_lens and loaded.cfg == llm.cfg
    state = [n for n in loaded.decode_module.state if n.endswith(".recurrent")]
    assert state and loaded.prefill_module.state[state[0]] is loaded.decode_module.state[state[0]]
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (9, 4)]
    ours = loaded.generate(prompts, max_new_tokens=8, ignore_eos=True)
    assert [g.ids for g in ours] == \
        [g.ids for g in llm.generate(prompts, max_new_tokens=8, ignore_eos=True)]
    ref = checkpoint[1].generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)
    assert ours[0].ids == ref[0, len(prompts[0]):].tolist()


def test_a_batch_of_different_lengths_matches_each_prompt_alone(checkpoint, llm):
    _, hf_model = checkpoint
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (11, 4)]
    ours = llm.generate(prompts, max_new_tokens=8, ignore_eos=True)
    for prompt, got in zip(prompts, ours):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert got.ids == ref[0, len(prompt):].tolist()


def test_config_decides_layers_and_feed_forward(checkpoint, llm):
    layers = llm.model.model.layers
    assert [layer.layer_type for layer in layers] == CONFIG["layer_types"]
    assert len(layers[0].mlp.experts) == 4 and hasattr(layers[1].mlp, "gate_proj")
    state = layers[0].linear_attn.state
    assert state.recurrent.shape == (2, 4, 16, 8) and state.recurrent.dtype == torch.float32
    assert state.conv.shape == (2, 3, 2 * 32 + 32)
    assert layers[1].self_attn.kv_cache is not None
    cfg = config_from_hf(read_json(checkpoint[0] / "config.json"))
    assert isinstance(cfg, Qwen3NextConfig) and cfg.rotary_dim == 4


def test_bad_config_and_paged_cache_are_refused(checkpoint, llm):
    hf = read_json(checkpoint[0] / "config.json")
    with pytest.raises(CheckpointError, match="layer_types"):
        config_from_hf({**hf, "layer_types": ["linear_attention", "sliding_attention"]})
    with pytest.raises(CheckpointError, match="linear_num_key_heads"):
        config_from_hf({k: v for k, v in hf.items() if k != "linear_num_key_heads"})
    with pytest.raises(ArgumentError, match="contiguous cache"):
        llm.model.setup_cache(paged=True)


def test_multi_token_prediction_weights_are_skipped_unknown_ones_refused(llm, tmp_path):
    from kiln.models.hf import check_tensors

    found = {n: (tmp_path / "model.safetensors", tuple(p.shape))
             for n, p in llm.model.named_parameters()}
    found["mtp.fc.weight"] = (tmp_path / "model.safetensors", (64, 128))
    assert sorted(check_tensors(llm.model, found)) == sorted(
        n for n, _ in llm.model.named_parameters())
    found["model.layers.0.linear_attn.extra.weight"] = (tmp_path / "model.safetensors", (4,))
    with pytest.raises(CheckpointError, match="tensor\\(s\\) the model lacks"):
        check_tensors(llm.model, found)
