"""A DeepSeek-V3 fp8 checkpoint on a CUDA GPU: its projections and routed experts stay
fp8 by default (nothing is dequantised at load), every projection runs as kiln's
generated fp8 GEMM, the experts as its fp8 grouped MoE kernel, and prefill and decode
steps in bf16 match eager bf16 on the same GPU, or are no further than it from the
CPU's fp32 run of the same fp8 model."""

import pytest
import torch

import kiln.models
from kiln.models import deepseek_v3_checkpoint as ds
from kiln.models.fp8 import Fp8Linear
from kiln.models.moe import Fp8Experts
from tests.helpers import assert_lowp_close
from tests.models.test_deepseek_v3 import CONFIG, make_hf_model
from tests.models.test_deepseek_v3_fp8 import write_fp8_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    hf_model = make_hf_model(seed=5, intermediate_size=200, num_attention_heads=8,
                             num_key_value_heads=8, q_lora_rank=136)
    path = tmp_path_factory.mktemp("dsv3_fp8_gpu")
    write_fp8_checkpoint(path, hf_model)
    return path


def _steps(run, tokens):
    """Logits of a 9-token prefill and 3 decode steps."""
    out = [run(tokens[:, :9], torch.arange(9))]
    out += [run(tokens[:, p:p + 1], torch.tensor([p])) for p in (9, 10, 11)]
    return torch.cat(out, 1).float().cpu()


def test_fp8_checkpoint_stays_fp8_on_cuda(fp8_dir, monkeypatch):
    dequantised = []
    real = ds.dequantize_blocks
    monkeypatch.setattr(ds, "dequantize_blocks",
                        lambda w, s, b: dequantised.append(w.shape) or real(w, s, b))
    llm = kiln.models.load(fp8_dir, target="cuda", max_seq_len=32)  # bf16, keep_fp8 auto
    assert dequantised == []
    experts = llm.model.model.layers[1].mlp.experts
    assert isinstance(experts, Fp8Experts) and experts.down_proj.is_cuda
    q_b = llm.model.model.layers[1].self_attn.q_b_proj
    assert isinstance(q_b, Fp8Linear) and q_b.weight.is_cuda
    assert q_b.weight.dtype == torch.float8_e4m3fn
    for module in (llm.prefill_module, llm.decode_module):
        kernels = [module.program.kplan.kernels[r.name] for r in module.program.plan.regions
                   if any(op.target in ("kiln.fp8_linear.default",
                                        "kiln.moe_experts_fp8.default") for op in r.ops)]
        assert kernels and all(type(k).__name__ == "TritonKernel" for k in kernels), \
            [type(k).__name__ for k in kernels]

    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 12),
                           generator=torch.Generator().manual_seed(8))
    eager, _ = ds.load_checkpoint(fp8_dir, torch.bfloat16, "cuda", max_seq_len=32)
    exact, _ = ds.load_checkpoint(fp8_dir, torch.float32, "cpu", max_seq_len=32,
                                  keep_fp8=True)
    for model in (eager, exact):
        model.setup_cache()
    with torch.no_grad():
        want_low = _steps(lambda t, p: eager(t.cuda(), p.cuda()), tokens)
        want = _steps(exact, tokens)
    got = _steps(llm.forward, tokens)
    assert_lowp_close(got, want_low, want, 1e-2)
