"""Loading Hugging Face checkpoints: sharded, dtype conversion, and every kind of bad input."""

import gc
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kiln.models.hf as hf
from kiln.errors import CheckpointError, ShapeError
from kiln.models.llama import Llama


@pytest.fixture
def ckpt(checkpoints, tmp_path):
    """A private copy of a checkpoint to damage: copy(family) -> dir."""

    def copy(family: str):
        dst = tmp_path / family
        shutil.copytree(checkpoints[family][0], dst)
        return dst

    return copy


def test_sharded_checkpoint_loads_every_tensor(checkpoints):
    path, hf_model = checkpoints["llama3.1"]
    assert (path / hf.INDEX).is_file() and len(list(path.glob("*.safetensors"))) > 2
    model, _ = hf.load_checkpoint(path)
    ref = hf_model.state_dict()
    ours = model.state_dict()
    assert set(ref) == set(ours)
    for name, t in ref.items():
        assert torch.equal(ours[name], t), name


def test_dtype_is_converted_on_load(checkpoints):
    path, hf_model = checkpoints["qwen2"]
    model, config = hf.load_checkpoint(path, dtype=torch.bfloat16)
    assert config["dtype"] == "float32"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = hf_model.model.layers[1].self_attn.q_proj.bias
    assert torch.equal(model.model.layers[1].self_attn.q_proj.bias, ref.to(torch.bfloat16))


def test_missing_config(ckpt):
    path = ckpt("qwen2")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        hf.load_checkpoint(path)


def test_no_safetensors_files(ckpt):
    path = ckpt("qwen2")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        hf.load_checkpoint(path)


def test_missing_shard(ckpt):
    path = ckpt("llama3.1")
    (path / "model-00003-of-00014.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-00003-of-00014.safetensors named "
                       "in model.safetensors.index.json is missing"):
        hf.load_checkpoint(path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_truncated_or_corrupt_file(ckpt, damage):
    path = ckpt("qwen2")
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    with pytest.raises(CheckpointError, match="cannot read model.safetensors") as e:
        hf.load_checkpoint(path)
    assert "truncated or corrupt" in str(e.value)


def test_tensor_with_the_wrong_shape(ckpt):
    path = ckpt("qwen2")
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(95, 64)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ShapeError, match=r"tensor model.layers.1.mlp.up_proj.weight in "
                       r"model.safetensors has shape \[95, 64\], config.json implies \[96, 64\]"):
        hf.load_checkpoint(path)


def test_missing_tensor(ckpt):
    path = ckpt("mistral")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing from the checkpoint: "
                       "model.layers.0.self_attn.k_proj.weight"):
        hf.load_checkpoint(path)


def test_config_that_does_not_describe_the_checkpoint(ckpt):
    path = ckpt("mistral")
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="tensor.s. the model lacks: model.layers.1"):
        hf.load_checkpoint(path)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     "architecture 'GPT2LMHeadModel' is not supported"),
    ({"architectures": None, "model_type": "falcon"}, "architecture 'falcon' is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "RoPE type 'yarn' is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_unsupported_configs(ckpt, change, message):
    path = ckpt("qwen2")
    config = json.loads((path / "config.json").read_text())
    config.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as e:
        hf.load_checkpoint(path)
    if "architecture" in message:
        assert "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM" in str(e.value)


def test_a_deepseek_config_given_to_the_llama_loader_says_where_it_loads():
    config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    with pytest.raises(CheckpointError, match="DeepSeek-V3") as e:
        hf.config_from_hf(config)
    assert "kiln.models.load" in str(e.value) and "not supported" not in str(e.value)


def test_old_style_rope_config_maps_like_the_new_one():
    new = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    old = {**new, "rope_theta": 5e5, "rope_scaling": {
        k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}}
    del old["rope_parameters"]
    assert hf.config_from_hf(new) == hf.config_from_hf(old)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear"},
    {"type": "linear", "factor": 0},
    {"rope_type": "llama3", "factor": "8", "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0},
])
def test_a_scaled_rope_without_a_positive_factor(scaling):
    """Without a factor the load raised a raw KeyError; a factor of 0 gave NaN logits."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
              "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16,
              "rope_scaling": scaling}
    # a string factor is refused by the generic number check first
    with pytest.raises(CheckpointError, match=r"RoPE (scaling has )?factor .*not a "
                       r"(positive|number)"):
        hf.config_from_hf(config)


def _live_llamas() -> set[int]:
    gc.collect()
    return {id(o) for o in gc.get_objects() if isinstance(o, Llama)}


def test_a_failed_load_leaves_nothing_in_memory(checkpoints, monkeypatch):
    """A read error after half the tensors: no module (or tensor) survives, even while
    the exception and its traceback are still alive."""
    path, _ = checkpoints["llama3.1"]
    real = hf.safe_open
    reads = []

    class FailingFile:
        def __init__(self, *a, **kw):
            self.f = real(*a, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            reads.append(name)
            if len(reads) > 10:
                raise OSError("Input/output error")
            return self.f.get_tensor(name)

    before = _live_llamas()
    monkeypatch.setattr(hf, "safe_open", FailingFile)
    with pytest.raises(CheckpointError, match="Input/output error") as e:
        hf.load_checkpoint(path)
    assert len(reads) == 11
    assert e.value.what.startswith("cannot read tensor data from ")
    assert e.value.where.endswith(".safetensors") and "download it again" in e.value.hint
    assert _live_llamas() <= before
