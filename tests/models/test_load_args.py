"""kiln.models.load's arguments and config.json's values, checked before anything is built.

Each of these ended in a raw exception from deep inside torch or Python (a negative
dim, a // by zero, `.get` of a list) before; all fail here in milliseconds.
"""

import json

import pytest

import kiln.models
import kiln.models.hf as hf
from kiln.errors import ArgumentError, CheckpointError, KilnError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 128}

DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 256,
            "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
            "max_position_embeddings": 128}


@pytest.mark.parametrize("kw,message", [
    ({"source": None}, "name a checkpoint directory or a preset, got NoneType"),
    ({"source": 3}, "name a checkpoint directory or a preset, got int"),
    ({"dtype": 5}, "dtype 5 is not one kiln's models run in"),
    ({"dtype": "float128"}, "unknown dtype 'float128'"),
    ({"max_seq_len": 0}, "max_seq_len must be a positive int, got 0"),
    ({"max_seq_len": "64"}, "max_seq_len must be a positive int, got '64'"),
    ({"max_seq_len": 10**9}, "max_seq_len 1000000000 exceeds preset tiny's context of 128"),
    ({"max_batch_size": 0}, "max_batch_size must be a positive int, got 0"),
    ({"block_size": 0, "paged": True}, "block_size must be a positive int, got 0"),
    ({"num_blocks": 1, "paged": True}, "num_blocks must be at least 2"),
    ({"seed": "s"}, "seed must be an int, got 's'"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int, got 0"),
    ({"pipeline_parallel_size": "2"}, "pipeline_parallel_size must be a positive int"),
    ({"target": 5}, "a target is named by a string, got int 5"),
])
def test_bad_load_arguments(kw, message):
    kw = {"source": "tiny", **kw}
    with pytest.raises(KilnError, match=message):
        kiln.models.load(kw.pop("source"), **kw)


def _config_dir(tmp_path, config) -> str:
    (tmp_path / "config.json").write_text(config if isinstance(config, str)
                                          else json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("config,message", [
    ("[1, 2]", "config.json holds a JSON list, not an object"),
    ('"text"', "config.json holds a JSON str, not an object"),
    ({**LLAMA, "hidden_size": None}, "hidden_size is None, not a positive int"),
    ({**LLAMA, "num_attention_heads": 0}, "num_attention_heads is 0, not a positive int"),
    ({**LLAMA, "vocab_size": -1}, "vocab_size is -1, not a positive int"),
    ({**LLAMA, "num_hidden_layers": "2"}, "num_hidden_layers is '2', not a positive int"),
    ({**LLAMA, "intermediate_size": 3.5}, "intermediate_size is 3.5, not a positive int"),
    ({**LLAMA, "max_position_embeddings": None}, "max_position_embeddings is None"),
    ({**LLAMA, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({**LLAMA, "hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads"),
    ({**LLAMA, "rope_scaling": "linear"}, "rope_scaling is 'linear', not an object"),
    ({**LLAMA, "rope_theta": "big"}, "rope_theta is 'big', not a positive number"),
    ({**LLAMA, "rms_norm_eps": "1e-6"}, "rms_norm_eps is '1e-6', not a number"),
    ({**DEEPSEEK, "routed_scaling_factor": None}, "routed_scaling_factor is None, not a num"),
    ({**DEEPSEEK, "rope_scaling": {"type": "yarn", "factor": "40"}},
     "RoPE factor is '40', not a number"),
])
def test_bad_config_json(tmp_path, config, message):
    with pytest.raises(CheckpointError, match=message):
        kiln.models.load(_config_dir(tmp_path, config), random_weights=True)


def test_nullable_sizes_take_their_defaults():
    cfg = hf.config_from_hf({**LLAMA, "num_key_value_heads": None, "head_dim": None,
                             "sliding_window": None})
    assert cfg.n_kv_heads == 4 and cfg.head_dim == 16


def test_config_json_that_is_a_directory(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(CheckpointError, match="cannot read config.json"):
        kiln.models.load(str(tmp_path))


def test_argument_errors_are_argument_errors():
    with pytest.raises(ArgumentError):
        kiln.models.load("tiny", max_batch_size=-1)
