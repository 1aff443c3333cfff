"""kiln.models.load and LLM.generate / forward under hostile input: missing and broken
checkpoints, config.json values of every wrong kind, bad load arguments, prompts and
sampling settings of the wrong type or range. Each is a clean KilnError (contract.py);
what works matches eager.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import kiln.models
from kiln.errors import (
    ArgumentError,
    CheckpointError,
    IndexOutOfRangeError,
    KilnError,
    ShapeError,
)
from tests.no_raw_exceptions.contract import NO_GPU, refused

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 64,
          "rope_theta": 10000.0, "rms_norm_eps": 1e-5}
WRONG = [None, "x", -1, 0, 2.5, [1], True]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A one-layer Llama from a config.json with random weights, compiled once (the
    tiny preset's two layers take longer): the LLM and an eager copy of its model."""
    path = tmp_path_factory.mktemp("one-layer")
    (path / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 1,
                                                  "max_position_embeddings": 32}))
    model = kiln.models.load(str(path), random_weights=True, max_batch_size=2)
    return model, copy.deepcopy(model.model)


def test_prefill_and_decode_match_eager(llm):
    model, eager = llm
    tokens = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6)
    with torch.no_grad():
        for out, ref in ((model.forward(tokens, pos), eager(tokens, pos)),
                         (model.forward(tokens[:, :1], torch.tensor([6])),
                          eager(tokens[:, :1], torch.tensor([6])))):
            err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            assert err < 1e-5, err
    result = model.generate([1, 2, 3], max_new_tokens=3, ignore_eos=True)
    assert len(result.ids) == 3
    refused(lambda: model.generate("text"), CheckpointError)  # no tokenizer.json


BAD_GENERATE = [
    ((None,), {}), ((3,), {}), ((3.5,), {}), (({"a": 1},), {}), (([1, "a"],), {}),
    (([1.5],), {}), (([[1], "a", 3],), {}), ((torch.linspace(0.1, 0.9, 3),), {}),
    ((torch.zeros(2, 2, 2, dtype=torch.long),), {}), (([],), {}), (("",), {}),
    (([-1],), {}), (([256],), {}), (([[1], [2], [3]],), {}), (([1] * 40,), {}),
    (("hi",), {"max_new_tokens": 0}), (("hi",), {"max_new_tokens": "3"}),
    (("hi",), {"max_new_tokens": 2.0}), (("hi",), {"temperature": -1}),
    (("hi",), {"temperature": "hot"}), (("hi",), {"top_k": 0}), (("hi",), {"top_k": 1.5}),
    (("hi",), {"top_p": 0}), (("hi",), {"top_p": 2}), (("hi",), {"top_p": "1"}),
    (("hi",), {"seed": "s"}), (("hi",), {"stop": [None]}), (("hi",), {"stop": 2.5}),
    (("hi",), {"on_text": 5}), ((["a", "b"],), {"on_text": print}),
]


@pytest.mark.parametrize("args,kw", BAD_GENERATE, ids=[f"{a!r:.20}-{k}" for a, k in
                                                        BAD_GENERATE])
def test_generate_refuses_bad_input(llm, args, kw):
    refused(lambda: llm[0].generate(*args, **kw), (ArgumentError, ShapeError, CheckpointError))


def test_generate_accepts_what_it_documents(llm):
    model = llm[0]
    for prompt, kw in [([3], {"stop": "x"}), ([1, 2], {"stop": 5}),
                       (torch.tensor([1, 2]), {"stop": ["a", 7]}),
                       ([[1, 2], (4,)], {"temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                         "seed": 1})]:
        out = model.generate(prompt, max_new_tokens=2, **kw)
        assert out is not None


@pytest.mark.parametrize("tokens,pos", [
    (torch.tensor([1, 2]), torch.arange(2)), (torch.tensor([[1.0, 2.0]]), torch.arange(2)),
    (torch.tensor([[1, 2]]), torch.arange(3)), (torch.tensor([[1, 2]]), "x"),
    ("hi", torch.arange(2)), (torch.zeros(3, 2, dtype=torch.long), torch.arange(2)),
    (torch.zeros(1, 40, dtype=torch.long), torch.arange(40)),
])
def test_forward_refuses_bad_shapes(llm, tokens, pos):
    refused(lambda: llm[0].forward(tokens, pos), KilnError)


def test_forward_with_ids_past_the_vocabulary(llm):
    refused(lambda: llm[0].forward(torch.tensor([[1, 300]]), torch.arange(2)),
            IndexOutOfRangeError)


BAD_LOAD = [
    {"source": None}, {"source": 3}, {"source": ""}, {"source": "huge"},
    {"source": "no/such/dir"}, {"dtype": 5}, {"dtype": torch.int64}, {"dtype": "float128"},
    {"max_seq_len": -3}, {"max_seq_len": 0}, {"max_seq_len": "x"}, {"max_seq_len": 10**9},
    {"max_batch_size": 0}, {"max_batch_size": -1}, {"block_size": 0, "paged": True},
    {"num_blocks": 1, "paged": True}, {"quantize": "int4"}, {"quantize": 5},
    {"target": "tpu"}, {"target": 5}, {"tensor_parallel_size": 0},
    {"tensor_parallel_size": "2"}, {"pipeline_parallel_size": -1}, {"seed": "x"},
    *([{"target": "cuda"}, {"cuda_graphs": True}] if NO_GPU else []),  # fine with a GPU
]


@pytest.mark.parametrize("kw", BAD_LOAD, ids=[str(k) for k in BAD_LOAD])
def test_load_refuses_bad_arguments(kw):
    kw = {"source": "tiny", **kw}
    refused(lambda: kiln.models.load(kw.pop("source"), **kw), KilnError)


def _checkpoint(tmp_path, config) -> str:
    path = tmp_path / "ckpt"
    path.mkdir(exist_ok=True)
    text = config if isinstance(config, (str, bytes)) else json.dumps(config)
    (path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


BROKEN_CONFIGS = [
    ("garbage", b"\x00\xff{"), ("empty", ""), ("a list", "[1, 2]"), ("a string", '"x"'),
    ("no architecture", {}), ("unknown architecture", {"architectures": ["BertModel"]}),
    ("gelu", {**CONFIG, "hidden_act": "gelu"}),
    ("rope_scaling a str", {**CONFIG, "rope_scaling": "linear"}),
    ("unknown rope type", {**CONFIG, "rope_scaling": {"rope_type": "weird"}}),
    ("rope_theta a str", {**CONFIG, "rope_theta": "big"}),
    ("heads that do not divide", {**CONFIG, "num_key_value_heads": 3}),
    ("hidden size that heads do not divide", {**CONFIG, "hidden_size": 66}),
    ("deepseek without its sizes", {**CONFIG, "model_type": "deepseek_v3",
                                    "architectures": ["DeepseekV3ForCausalLM"]}),
    *[(f"{key}={value!r}", {**CONFIG, key: value})
      for key in ("hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers",
                  "intermediate_size", "max_position_embeddings")
      for value in WRONG],
    *[(f"no {key}", {k: v for k, v in CONFIG.items() if k != key})
      for key in ("hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers",
                  "intermediate_size")],
]


@pytest.mark.parametrize("case", BROKEN_CONFIGS, ids=[c[0] for c in BROKEN_CONFIGS])
def test_load_refuses_broken_config_json(tmp_path, case):
    what, config = case
    path = _checkpoint(tmp_path, config)
    refused(lambda: kiln.models.load(path, random_weights=True), CheckpointError, what=what)


def test_load_refuses_broken_checkpoints(tmp_path):
    path = _checkpoint(tmp_path, CONFIG)
    refused(lambda: kiln.models.load(path), CheckpointError, what="no weights")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"garbage")
    refused(lambda: kiln.models.load(path), CheckpointError, what="garbage weights")
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text("[]")
    refused(lambda: kiln.models.load(path), CheckpointError, what="an index that is a list")
