"""The models people bring, written with no thought of kiln, on the CPU target: each
compiles and matches eager on fresh inputs. A zoo that grows: add what users report."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ExportError, KilnWarning

transformers = pytest.importorskip("transformers")


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _first(out):
    if hasattr(out, "keys"):
        return out[next(iter(out.keys()))]
    return out[0] if isinstance(out, tuple | list) else out


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-18's layout (stem, four stages of two basic blocks, pool, fc), narrow."""

    def __init__(self, width=8, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, stride in enumerate((1, 2, 2, 2)):
            cout = width * 2 ** i
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(
            self.blocks(self.stem(x)), 1), 1))


def _randomise_norm_stats(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_(1, 0.1)
                m.bias.normal_(0, 0.1)
    return model


def _hf(cls, cfg):
    torch.manual_seed(0)
    return cls(cfg).eval()


CASES = {
    "small_cnn_batchnorm": lambda: (_randomise_norm_stats(SmallCNN()),
                                    lambda: (torch.randn(2, 3, 16, 16),)),
    "resnet18_layout": lambda: (_randomise_norm_stats(ResNet()),
                                lambda: (torch.randn(1, 3, 32, 32),)),
    "transformer_encoder": lambda: (
        nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2),
        lambda: (torch.randn(2, 7, 32),)),
    "lstm": lambda: (nn.LSTM(8, 16, 2, batch_first=True), lambda: (torch.randn(2, 5, 8),)),
    "gru": lambda: (nn.GRU(8, 16, 1), lambda: (torch.randn(5, 2, 8),)),
    "hf_bert": lambda: (_hf(transformers.BertModel, transformers.BertConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=100)), lambda: (torch.randint(0, 100, (2, 9)),)),
}
HF_LMS = {
    "hf_llama": lambda: (transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100)),
    "hf_gpt2": lambda: (transformers.GPT2LMHeadModel, transformers.GPT2Config(
        n_embd=64, n_layer=2, n_head=4, vocab_size=100, bos_token_id=0, eos_token_id=0)),
    "hf_qwen2": lambda: (transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100)),
    # transformers 5 runs MoE experts through its own custom op (grouped_mm_fallback)
    "hf_mixtral": lambda: (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, num_local_experts=4,
        num_experts_per_tok=2)),
    "hf_gemma3": lambda: (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100, sliding_window=4)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_zoo_model_matches_eager(name):
    model, make_args = CASES[name]()
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)  # convolution etc. may fall back
        exe = kiln.compile(model, make_args())
    args = make_args()
    with torch.no_grad():
        assert _rel(_first(exe(*args)), _first(model(*args))) < 1e-5


@pytest.mark.parametrize("name", list(HF_LMS))
def test_hf_causal_lm_with_default_config(name):
    cls, cfg = HF_LMS[name]()
    model = _hf(cls, cfg)
    ids = torch.randint(0, 100, (2, 9))
    with pytest.raises(ExportError) as e:  # the default config returns a DynamicCache
        kiln.compile(model, (ids,))
    assert "DynamicCache" in str(e.value) and "use_cache=False" in str(e.value)
    assert "TorchExportableModuleWithStaticCache" in e.value.hint  # decode: the recipe
    exe = kiln.compile(model, (ids,), {"use_cache": False})
    fresh = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        ref = model(fresh, use_cache=False).logits
    assert _rel(exe(fresh, use_cache=False).logits, ref) < 1e-5


DYNAMIC_LMS = {
    # ALiBi: a [1, heads, 1, max] bias sliced to the last t positions (a symbolic,
    # negative slice start; torch's unit dim 1 - Max(0, 1 - t))
    "hf_mpt": lambda: (transformers.MptForCausalLM, transformers.MptConfig(
        d_model=64, n_heads=4, n_layers=2, vocab_size=100)),
    "hf_phi3": lambda: (transformers.Phi3ForCausalLM, transformers.Phi3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, pad_token_id=0)),
    # RoPE after a q / k RMSNorm: a prefill's query RoPE becomes a pointwise region of
    # its own, and the key's too (dispatch/split_attention_prologues.py)
    "hf_qwen3": lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=100)),
}


@pytest.mark.parametrize("name", list(DYNAMIC_LMS))
def test_hf_lm_with_a_dynamic_length_on_generated_kernels(name):
    """The interpret target runs the Triton kernels kiln generates: at lengths other
    than the example's too (MPT was 0.1-0.5 off, or NaN, before the slice fix)."""
    cls, cfg = DYNAMIC_LMS[name]()
    model = _hf(cls, cfg)
    T = kiln.Dim("seq", min=2, max=64)
    exe = kiln.compile(model, (), {"input_ids": torch.randint(0, 100, (2, 7)), "use_cache": False},
                       dynamic_shapes={"input_ids": {1: T}, "use_cache": None}, target="interpret")
    for t in (5, 13):
        ids = torch.randint(0, 100, (2, t))
        with torch.no_grad():
            ref = model(input_ids=ids, use_cache=False).logits
            assert _rel(exe(input_ids=ids, use_cache=False).logits, ref) < 1e-5, t


MORE_LMS = {  # from the architecture sweep (tests/fuzz/FINDINGS.md), run on the generated kernels
    "phi3": ("Phi3ForCausalLM", "Phi3Config", {"pad_token_id": 0}),
    "falcon": ("FalconForCausalLM", "FalconConfig", {"num_key_value_heads": None}),
    "bloom_alibi": ("BloomForCausalLM", "BloomConfig", {}),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 16, "sliding_window": 4}),
    # the second sweep (2026-11-29, tenth session): attention sinks, sliding and full
    # layers, MoE with a clamped SwiGLU; latent attention (MLA); a short causal conv
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", {
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"]}),
    "deepseek_v2_mla": ("DeepseekV2ForCausalLM", "DeepseekV2Config", {
        "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_intermediate_size": 32,
        "n_group": 1, "topk_group": 1}),
    "lfm2_conv": ("Lfm2ForCausalLM", "Lfm2Config", {
        "layer_types": ["conv", "full_attention"], "block_ff_dim": 128}),
    # the third sweep (twenty-third session): a selective-scan SSM; attention and MLP
    # in parallel with sliding layers
    "mamba": ("MambaForCausalLM", "MambaConfig", {"state_size": 8, "expand": 2}),
    "cohere2": ("Cohere2ForCausalLM", "Cohere2Config", {"head_dim": 16, "sliding_window": 4}),
}


def _more_config(cfg_cls, extra):
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
            "n_layer": 2, "n_head": 4}
    kw = {k: v for k, v in {**base, **extra}.items() if v is not None}
    return getattr(transformers, cfg_cls)(**kw)


@pytest.mark.parametrize("name", list(MORE_LMS))
def test_more_architectures_on_generated_kernels(name):
    cls, cfg_cls, extra = MORE_LMS[name]
    model = _hf(getattr(transformers, cls), _more_config(cfg_cls, extra))
    ids = torch.randint(0, 100, (2, 9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KilnWarning)
        exe = kiln.compile(model, (ids,), {"use_cache": False}, target="interpret")
    fresh = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        ref = model(fresh, use_cache=False).logits
    assert _rel(exe(fresh, use_cache=False).logits, ref) < 1e-5
