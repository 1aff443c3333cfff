"""Lifted constants that are the model's buffers (frontend/lifted_buffers.py): a state
written through a plain Python object, as transformers' StaticCache is in its export
recipe, compiles and keeps its values from call to call; a written tensor that is no
buffer is refused with what to do; a written plain tensor attribute (Meta's KV cache) is
exported as a buffer."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.errors import ExportError


class _Holder:  # a plain object holding state, as transformers' StaticCache
    def __init__(self):
        self.k = torch.zeros(1, 8, 4)


class Cached(torch.nn.Module):
    def __init__(self, register: bool = True):
        super().__init__()
        self.cache = _Holder()
        if register:
            self.register_buffer("k_cache", self.cache.k, persistent=False)
        self.w = torch.nn.Linear(4, 4)

    def forward(self, x, pos):
        self.cache.k.index_copy_(1, pos, self.w(x))
        return self.cache.k.sum(1)


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_a_buffer_written_through_a_plain_object_is_the_compiled_modules_state():
    """Without the pass torch's decomposition failed on the buffer / constant pair
    (AssertionError: expected compiled_fn to be GraphModule)."""
    torch.manual_seed(0)
    model, ref = Cached().eval(), Cached().eval()
    ref.load_state_dict(model.state_dict())
    exe = kiln.compile(model, (torch.randn(1, 2, 4), torch.tensor([0, 1])), target="cpu")
    for pos in ([0, 1], [2, 3], [6, 7]):
        x = torch.randn(1, 2, 4)
        with torch.no_grad():
            assert _rel(exe(x, torch.tensor(pos)), ref(x, torch.tensor(pos))) < 1e-6


def test_a_written_tensor_that_is_no_buffer_is_refused_with_what_to_do():
    with pytest.raises(ExportError) as e:
        kiln.compile(Cached(register=False).eval(),
                     (torch.randn(1, 2, 4), torch.tensor([0, 1])), target="cpu")
    text = str(e.value)
    assert "writes in place" in text and "lifted_tensor" in text
    assert "register_buffer" in text


class MetaCache(torch.nn.Module):
    """Meta's Llama keeps its KV cache as plain tensor attributes (self.cache_k =
    torch.zeros(...)), written with an index assignment."""

    def __init__(self):
        super().__init__()
        self.cache_k = torch.zeros(1, 8, 4)

    def forward(self, x, pos):
        self.cache_k[:, pos] = x
        return self.cache_k.sum(1)


class MetaLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = MetaCache()

    def forward(self, x, pos):
        return self.attention(x, pos)


def test_a_written_plain_tensor_attribute_is_the_compiled_modules_state():
    """It was refused ('a plain tensor attribute ... that is no registered buffer'): now
    it is exported as a buffer, its writes kept from call to call, and the model's
    attribute stays a plain tensor."""
    model, ref = MetaLayer(), MetaLayer()
    exe = kiln.compile(model, (torch.randn(1, 2, 4), torch.tensor([0, 1])), target="cpu")
    assert "cache_k" in vars(model.attention) and not dict(model.named_buffers())
    for pos in ([0, 1], [2, 3], [6, 7]):
        x = torch.randn(1, 2, 4)
        assert _rel(exe(x, torch.tensor(pos)), ref(x, torch.tensor(pos))) < 1e-6


def _static_cache_module(cls_prefix: str, **extra):
    transformers = pytest.importorskip("transformers")
    executorch = pytest.importorskip("transformers.integrations.executorch")
    torch.manual_seed(0)
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=128, **extra)
    model = getattr(transformers, f"{cls_prefix}ForCausalLM")(
        getattr(transformers, f"{cls_prefix}Config")(**kw)).eval()
    model.generation_config.cache_implementation = "static"

    def wrapped():
        return executorch.TorchExportableModuleWithStaticCache(
            model, batch_size=1, max_cache_len=32, device="cpu")
    return wrapped


@pytest.mark.parametrize("family,extra,target", [
    ("Qwen3", dict(head_dim=16), "cpu"),
    ("Phi3", dict(pad_token_id=0), "cpu"),  # fused qkv and gate_up projections
    ("Qwen3Moe", dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                      moe_intermediate_size=32), "interpret"),
])
def test_transformers_static_cache_export_recipe_prefills_and_decodes(family, extra, target):
    """transformers' own recipe for exporting an HF model with a static KV cache
    (TorchExportableModuleWithStaticCache), compiled as it is with a dynamic prompt
    length: a prompt, then one token at a time, equal to the recipe's module run eagerly
    with its own cache (a MoE family on the interpret target: generated kernels)."""
    make = _static_cache_module(family, **extra)
    module, ref = make(), make()
    T = kiln.Dim("T", min=1, max=32)
    ids = torch.randint(3, 100, (1, 5))
    exe = kiln.compile(module, (), {"input_ids": ids, "cache_position": torch.arange(5)},
                       dynamic_shapes={"input_ids": {1: T}, "cache_position": {0: T}},
                       target=target)
    steps = [(torch.randint(3, 100, (1, 6)), torch.arange(6))]
    steps += [(torch.randint(3, 100, (1, 1)), torch.tensor([p])) for p in (6, 7, 8)]
    with torch.no_grad():
        for ids, pos in steps:
            got = exe(input_ids=ids, cache_position=pos)
            want = ref(input_ids=ids, cache_position=pos)
            assert _rel(got, want) < 1e-5, (family, pos)
