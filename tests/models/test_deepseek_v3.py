"""DeepSeek-V3 checkpoints made by transformers (tiny, random), run by kiln, match it:
logits over a prefill and decode steps, greedy tokens, the routed experts; the
absorbed and expanded attention agree. fp8 checkpoints: test_deepseek_v3_fp8.py."""

import json

import pytest
import torch

from kiln.errors import CheckpointError, KilnError, ShapeError
from kiln.models import deepseek_v3_checkpoint as ds
from kiln.models.deepseek_v3 import DeepseekV3Config, rope_parameters
from kiln.models.moe import MoE
from tests.helpers import rel_err

transformers = pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
        "beta_fast": 32, "beta_slow": 1}
CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
              kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, v_head_dim=16,
              qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
              first_k_dense_replace=1, max_position_embeddings=128, initializer_range=0.1,
              rope_parameters=YARN, eos_token_id=None)
MOE_LAYER = 1


def make_hf_model(seed: int = 0, **overrides):
    """A random tiny DeepseekV3ForCausalLM whose norms and router biases matter too."""
    cfg = transformers.DeepseekV3Config(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, transformers model): sharded, with model.safetensors.index.json."""
    path = tmp_path_factory.mktemp("dsv3")
    model = make_hf_model()
    model.save_pretrained(str(path), max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file()
    return path, model


@pytest.fixture(scope="module")
def llm(checkpoint):
    import kiln.models

    return kiln.models.load(checkpoint[0], dtype=torch.float32, max_seq_len=64,
                            max_batch_size=2)


def test_logits_match_transformers_over_prefill_and_decode(checkpoint, llm):
    _, hf_model = checkpoint
    assert llm.model.model.layers[MOE_LAYER].mlp.gate.e_score_correction_bias.abs().min() > 0
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 20),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf_model(tokens).logits
    prompt = 13
    out = [llm.forward(tokens[:, :prompt], torch.arange(prompt))]
    for p in range(prompt, tokens.shape[1]):  # decode steps: the absorbed form
        out.append(llm.forward(tokens[:, p:p + 1], torch.tensor([p])))
    out = torch.cat(out, dim=1)
    for p in range(tokens.shape[1]):
        assert rel_err(out[:, p], ref[:, p]) <= 1e-4, (p, rel_err(out[:, p], ref[:, p]))


def _greedy_reference(hf_model, prompt: list[int], steps: int = 16) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_match_transformers(checkpoint, llm):
    _, hf_model = checkpoint
    prompt = torch.randint(3, CONFIG["vocab_size"], (7,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    ref = _greedy_reference(hf_model, prompt)
    assert len(set(ref)) >= 8, ref  # a varied run, not one token repeated
    assert llm.generate(prompt, max_new_tokens=16, ignore_eos=True).ids == ref
    # a batch of two prompts of different lengths: decode steps route two tokens at once
    other = [5, 9, 77, 31]
    both = llm.generate([prompt, other], max_new_tokens=16, ignore_eos=True)
    assert [g.ids for g in both] == [ref, _greedy_reference(hf_model, other)]


def test_saved_llm_generates_the_same_tokens(checkpoint, llm, tmp_path):
    """The MoE model's config (DeepseekV3Config) and its latent cache survive a save."""
    import kiln.models

    llm.save(tmp_path / "dsv3.kiln")
    loaded = kiln.models.load(tmp_path / "dsv3.kiln")
    prompt = torch.randint(3, CONFIG["vocab_size"], (7,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    assert loaded.cfg == llm.cfg
    assert loaded.generate(prompt, max_new_tokens=16, ignore_eos=True).ids == \
        _greedy_reference(checkpoint[1], prompt)


def _weights_read(compiled) -> set[str]:
    """The parameters and buffers a compiled module's kernels read."""
    plan = compiled.plan
    return {str(plan.values[v].target) for r in plan.regions for v in r.inputs
            if plan.values[v].target is not None}


def test_compiled_decode_attends_over_the_latent_cache(llm):
    attn = f"model.layers.{MOE_LAYER}.self_attn"
    decode, prefill = _weights_read(llm.decode_module), _weights_read(llm.prefill_module)
    assert {f"{attn}.w_uk", f"{attn}.w_uv", f"{attn}.latent_cache.latent_cache"} <= decode
    assert f"{attn}.kv_b_proj.weight" not in decode  # the cache is never expanded
    assert f"{attn}.kv_b_proj.weight" in prefill and f"{attn}.w_uk" not in prefill


def _routed_ids(router, run) -> torch.Tensor:
    """The expert ids `router` (a module returning (..., ids)) picks during run()."""
    seen = []
    handle = router.register_forward_hook(lambda m, i, out: seen.append(out[-1]))
    try:
        with torch.no_grad():
            run()
    finally:
        handle.remove()
    return seen[0].sort(dim=-1).values


def test_expert_choice_matches_transformers_and_the_bias_changes_it(checkpoint):
    path, hf_model = checkpoint
    ours, _ = ds.load_checkpoint(path, torch.float32)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 24),
                           generator=torch.Generator().manual_seed(2))
    ref = _routed_ids(hf_model.model.layers[MOE_LAYER].mlp.gate, lambda: hf_model(tokens))
    router = ours.model.layers[MOE_LAYER].mlp.gate
    got = _routed_ids(router, lambda: ours(tokens, torch.arange(24)))
    assert got.shape == (24, CONFIG["num_experts_per_tok"])
    assert torch.equal(got, ref)
    router.e_score_correction_bias.zero_()  # the bias decides some tokens' experts
    unbiased = _routed_ids(router, lambda: ours(tokens, torch.arange(24)))
    assert not torch.equal(unbiased, ref)


def test_absorbed_decode_equals_the_expanded_form(checkpoint):
    model, _ = ds.load_checkpoint(checkpoint[0], torch.float32, max_seq_len=32)
    model.setup_cache()
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 12),
                           generator=torch.Generator().manual_seed(3))

    def run(prefill, decode):
        """Logits of a 6-token prefill in forms `prefill`, then 6 steps in `decode`."""
        with torch.no_grad():
            model.use_forms(*prefill)
            out = [model(tokens[:, :6], torch.arange(6))]
            model.use_forms(*decode)
            out += [model(tokens[:, p:p + 1], torch.tensor([p])) for p in range(6, 12)]
        return torch.cat(out, dim=1)

    absorbed = run(("absorbed", "gathered"), ("absorbed", "gathered"))
    expanded = run(("expanded", "dense"), ("expanded", "dense"))
    assert rel_err(absorbed, expanded) <= 1e-5
    assert rel_err(run(("absorbed", "grouped"), ("absorbed", "grouped")), expanded) <= 1e-5
    # auto: expanded attention and grouped experts for the prefill, absorbed attention
    # and gathered experts for each one-token step of one row
    auto = run(("auto", "auto"), ("auto", "auto"))
    assert torch.equal(auto, run(("expanded", "grouped"), ("absorbed", "gathered")))


def test_compiled_prefill_groups_the_experts_and_small_decode_gathers_them(llm):
    """auto: the prefill (dynamic T) runs kiln::moe_experts; a decode module of at most
    four rows (this one: two) gathers the chosen experts' weights; more rows group."""
    def moe_ops(compiled):
        return [op for r in compiled.plan.regions for op in r.ops
                if op.target == "kiln.moe_experts.default"]

    assert len(moe_ops(llm.prefill_module)) == 1 and not moe_ops(llm.decode_module)
    mlp = llm.model.model.layers[MOE_LAYER].mlp
    assert mlp.decode_batch == 2 and mlp.form_for(object(), 1) == "gathered"
    symbolic = object()  # a traced batch: not an int
    mlp.decode_batch = 8
    try:
        assert mlp.form_for(symbolic, 1) == "grouped" and mlp.form_for(3, 1) == "gathered"
        assert mlp.form_for(1, symbolic) == "grouped" and mlp.form_for(1, 5) == "grouped"
    finally:
        mlp.decode_batch = 2


def test_absorbed_form_without_a_cache_attends_over_the_call_s_own_tokens(checkpoint):
    model, _ = ds.load_checkpoint(checkpoint[0], torch.float32, max_seq_len=32)
    assert model.cache is None
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 7),
                           generator=torch.Generator().manual_seed(6))
    outs = []
    for form in ("absorbed", "expanded"):
        model.use_forms(form, "dense")
        with torch.no_grad():
            outs.append(model(tokens, torch.arange(3, 10)))  # positions need not start at 0
    assert rel_err(outs[0], outs[1]) <= 1e-5


def test_interpret_target_runs_the_generated_latent_attention_kernel(checkpoint):
    """On a Triton target absorbed decode is kiln's latent attention kernel over the
    paged cache as stored (templates/latent_attention), and the prefill's experts are
    its grouped MoE kernel (templates/moe): logits of a prefill and decode steps as
    transformers', and a batch of two prompts of different lengths decodes each as
    alone."""
    import kiln.models
    from kiln.codegen.build.triton_kernel import TritonKernel

    path, hf_model = checkpoint
    llm = kiln.models.load(path, dtype=torch.float32, target="interpret", max_seq_len=32,
                           max_batch_size=2, paged=True, block_size=4)
    exe = llm.decode_module
    kernels = [exe.program.kplan.kernels[r.name] for r in exe.program.plan.regions
               if any(op.target == "kiln.latent_attention.default" for op in r.ops)]
    assert len(kernels) == CONFIG["num_hidden_layers"]
    assert all(isinstance(k, TritonKernel) for k in kernels)
    # the prefill's routed experts are kiln's grouped MoE kernel (templates/moe)
    pre = llm.prefill_module.program
    moe = [pre.kplan.kernels[r.name] for r in pre.plan.regions
           if any(op.target == "kiln.moe_experts.default" for op in r.ops)]
    assert len(moe) == 1 and isinstance(moe[0], TritonKernel)  # one MoE layer of two
    for module in (llm.prefill_module, llm.decode_module):  # the router's three topks
        topks = [module.program.kplan.kernels[r.name] for r in module.program.plan.regions
                 if r.kind == "topk"]
        assert len(topks) == 3 and all(isinstance(k, TritonKernel) for k in topks)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 12),
                           generator=torch.Generator().manual_seed(5))
    table = torch.tensor([[3, 1, 2]])  # blocks out of order
    with torch.no_grad():
        ref = hf_model(tokens).logits
    out = [llm.forward(tokens[:, :9], torch.arange(9), table)]
    out += [llm.forward(tokens[:, p:p + 1], torch.tensor([p]), table) for p in (9, 10, 11)]
    out = torch.cat(out, dim=1)
    assert rel_err(out[:, 9:], ref[:, 9:]) <= 1e-4, rel_err(out[:, 9:], ref[:, 9:])
    prompts = [[5, 9, 77, 31, 2, 8, 40, 19, 3], [11, 60, 7]]  # 9 and 3: not whole blocks
    got = llm.generate(prompts, max_new_tokens=4, ignore_eos=True)
    assert [g.ids for g in got] == [_greedy_reference(hf_model, p, 4) for p in prompts]


def test_bfloat16_matches_transformers_in_bfloat16(checkpoint):
    path, hf_model = checkpoint
    model, _ = ds.load_checkpoint(path, torch.bfloat16, max_seq_len=32)
    assert model.model.layers[MOE_LAYER].mlp.gate.e_score_correction_bias.dtype == \
        torch.float32
    model.setup_cache()
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 10),
                           generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = reference.eval()(tokens).logits.float()
        out = [model(tokens[:, :7], torch.arange(7))]
        out += [model(tokens[:, p:p + 1], torch.tensor([p])) for p in (7, 8, 9)]
    assert rel_err(torch.cat(out, dim=1).float(), ref) <= 2e-2


def test_router_weight_stored_fp32_stays_fp32_in_a_bfloat16_model(checkpoint, tmp_path):
    """transformers keeps the router's weight fp32 in a bf16 model, and saves it so; kiln
    rounded it to bf16 (at V3's sizes about 1.5% of tokens then pick other experts). One
    stored bf16 stays bf16: the router computes in fp32 either way."""
    path, _ = checkpoint
    reference = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    reference.save_pretrained(str(tmp_path / "bf16"))
    stored = reference.model.layers[MOE_LAYER].mlp.gate.weight
    assert stored.dtype == torch.float32
    model, _ = ds.load_checkpoint(tmp_path / "bf16", max_seq_len=16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[MOE_LAYER].mlp.gate.weight, stored)
    meta, _ = ds.load_checkpoint(tmp_path / "bf16", weights=False)  # a multi-device load's
    assert meta.model.layers[MOE_LAYER].mlp.gate.weight.dtype == torch.float32
    reference.to(torch.bfloat16).save_pretrained(str(tmp_path / "all_bf16"))
    model, _ = ds.load_checkpoint(tmp_path / "all_bf16", max_seq_len=16)
    assert model.model.layers[MOE_LAYER].mlp.gate.weight.dtype == torch.bfloat16


def test_a_multi_device_load_exports_over_the_fp32_rope_tables_its_ranks_run_with(
        checkpoint):
    """weights=False (tensor parallelism) in bf16: the meta model's RoPE tables are fp32,
    as LLM._materialize's init_rope makes them. They were bf16, so the exported plan had
    no cast of them, and a TP=2 bf16 load failed its first call with a raw index_put
    dtype error (fp32 latents into the bf16 cache)."""
    meta, _ = ds.load_checkpoint(checkpoint[0], torch.bfloat16, weights=False)
    assert meta.lm_head.weight.dtype == torch.bfloat16
    assert meta.rope_cos.dtype == meta.rope_sin.dtype == torch.float32
    assert meta.rope_cos.is_meta


def test_paged_latent_cache_matches_the_contiguous_one(checkpoint):
    model, _ = ds.load_checkpoint(checkpoint[0], torch.float32, max_seq_len=32)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 10),
                           generator=torch.Generator().manual_seed(4))
    outs = []
    for paged in (False, True):
        model.setup_cache(paged=paged, block_size=4)
        table = torch.tensor([[3, 1, 2]]) if paged else None  # blocks out of order
        with torch.no_grad():
            out = [model(tokens[:, :7], torch.arange(7), table)]
            out += [model(tokens[:, p:p + 1], torch.tensor([[p]]), table) for p in (7, 8, 9)]
        outs.append(torch.cat(out, dim=1))
    assert rel_err(outs[1], outs[0]) <= 1e-6


def test_yarn_rope_matches_transformers(checkpoint):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, hf_model = checkpoint
    cfg = ds.config_from_hf(hf_model.config.to_dict())
    inv_freq, attn_factor, scale = rope_parameters(cfg)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_model.config)
    torch.testing.assert_close(inv_freq, ref_freq, rtol=1e-6, atol=0)
    assert attn_factor == pytest.approx(ref_factor) and attn_factor != 1.0
    assert scale == pytest.approx(hf_model.model.layers[0].self_attn.scaling)
    assert scale != pytest.approx(cfg.qk_head_dim ** -0.5)


def test_yarn_without_original_max_position_embeddings_is_transformers_default():
    """An older config.json's rope_scaling may leave out original_max_position_embeddings:
    transformers takes max_position_embeddings (kiln raised a raw KeyError). Without a
    factor as well, a KilnError."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = {**CONFIG, "rope_theta": 10000.0, "rope_parameters": None,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "mscale": 1.0,
                               "mscale_all_dim": 0.8}}
    inv_freq, attn_factor, scale = rope_parameters(ds.config_from_hf(config))
    hf_config = transformers.DeepseekV3Config(**config)  # fills rope_scaling in place
    assert hf_config.rope_parameters["original_max_position_embeddings"] == 128
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config)
    torch.testing.assert_close(inv_freq, ref_freq, rtol=1e-6, atol=0)
    assert attn_factor == pytest.approx(ref_factor)
    hf_attention = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention
    assert scale == pytest.approx(hf_attention(hf_config, 0).scaling)
    with pytest.raises(KilnError, match="YaRN RoPE scaling without factor"):
        rope_parameters(DeepseekV3Config(rope_scaling={"rope_type": "yarn",
                                                       "original_max_position_embeddings": 8}))


def test_config_variants_match_transformers(tmp_path):
    """No query LoRA, attention biases, plain (halves) RoPE without scaling, unnormalised
    expert weights, two shared experts, no dense layer: eager, against transformers."""
    hf_model = make_hf_model(seed=7, q_lora_rank=None, attention_bias=True,
                             rope_interleave=False, norm_topk_prob=False, n_shared_experts=2,
                             first_k_dense_replace=0, num_hidden_layers=2,
                             rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
    hf_model.save_pretrained(str(tmp_path))
    model, _ = ds.load_checkpoint(tmp_path, torch.float32, max_seq_len=32)
    assert model.cfg.q_lora_rank is None and model.cfg.rope_scaling is None
    assert isinstance(model.model.layers[0].mlp, MoE)
    model.setup_cache()
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 10),
                           generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = hf_model(tokens).logits
        out = [model(tokens[:, :7], torch.arange(7))]
        out += [model(tokens[:, p:p + 1], torch.tensor([p])) for p in (7, 8, 9)]
    assert rel_err(torch.cat(out, dim=1), ref) <= 1e-5


def test_first_k_dense_replace_past_the_last_layer_makes_every_layer_dense(tmp_path):
    """transformers' default first_k_dense_replace (3) over a 2-layer model: all dense,
    as transformers builds it (kiln refused the config)."""
    hf_model = make_hf_model(seed=4, first_k_dense_replace=3)
    hf_model.save_pretrained(str(tmp_path))
    model, _ = ds.load_checkpoint(tmp_path, torch.float32, max_seq_len=16)
    assert not any(isinstance(layer.mlp, MoE) for layer in model.model.layers)
    tokens = torch.tensor([[4, 80, 15, 9, 33, 2]])
    with torch.no_grad():
        assert rel_err(model(tokens, torch.arange(6)), hf_model(tokens).logits) <= 1e-5


def test_random_model_from_a_config(checkpoint):
    cfg = ds.config_from_hf(checkpoint[1].config.to_dict(), max_seq_len=16)
    model = ds.random_model(cfg, torch.bfloat16, seed=1)
    attn = model.model.layers[0].self_attn
    assert attn.q_a_layernorm.weight.eq(1).all() and attn.w_uk.dtype == torch.bfloat16
    nope = cfg.qk_nope_head_dim
    assert torch.equal(attn.w_uk[1], attn.kv_b_proj.weight[(nope + cfg.v_head_dim):][:nope].T)
    bias = model.model.layers[MOE_LAYER].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and not bias.any()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]]), torch.arange(3))
    assert logits.shape == (1, 3, cfg.vocab_size) and logits.isfinite().all()


# ---- bad checkpoints -------------------------------------------------------------------


def test_experts_not_divisible_into_groups_is_a_clear_error(tmp_path):
    import kiln.models

    config = transformers.DeepseekV3Config(**{**CONFIG, "n_routed_experts": 6}).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ShapeError, match="n_routed_experts 6 is not divisible by n_group 4") \
            as err:
        kiln.models.load(tmp_path, random_weights=True)
    assert "config.json" in err.value.where
    with pytest.raises(ShapeError, match="exceeds n_group"):
        DeepseekV3Config(n_group=2, topk_group=3, n_routed_experts=8)


@pytest.mark.parametrize("method", ["awq", "compressed-tensors"])
def test_other_quantizations_are_refused_by_name(tmp_path, checkpoint, method):
    """An AWQ or compressed-tensors copy of a DeepSeek-V3 checkpoint: refused before any
    tensor is read, naming the method (its qweight / weight_scale tensors were reported
    as tensors the model lacks, hinting at layers or experts)."""
    import kiln.models

    for f in checkpoint[0].iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((checkpoint[0] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"quant_method '{method}' is not supported"):
        kiln.models.load(tmp_path)


def test_a_missing_expert_is_a_checkpoint_error(tmp_path, checkpoint):
    path, hf_model = checkpoint
    cfg = ds.config_from_hf(hf_model.config.to_dict())
    with torch.device("meta"):
        model = ds.DeepseekV3(cfg)
    found = ds.hf.read_headers(ds.hf.weight_files(path))
    assert isinstance(model.model.layers[MOE_LAYER].mlp, MoE)
    del found[f"model.layers.{MOE_LAYER}.mlp.experts.5.up_proj.weight"]
    with pytest.raises(CheckpointError, match="missing"):
        ds.tensor_map(model, found)
