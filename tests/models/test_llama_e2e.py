"""The spine's acceptance test: the tiny Llama compiled for the CPU matches eager."""

import copy

import pytest
import torch

import kiln
from kiln.models.llama import example_inputs, tiny_llama
from tests.helpers import rel_err


@pytest.fixture(scope="module")
def compiled_fp32():
    """(model, eager twin, compiled module): every test drives both through the same calls
    from position 0, so their caches stay equal."""
    model = tiny_llama()
    eager = copy.deepcopy(model)
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    return model, eager, kiln.compile(model, args, dynamic_shapes=dynamic)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_prefill_then_decode_matches_eager(dtype, tol, compiled_fp32):
    if dtype == torch.float32:
        model, eager, exe = compiled_fp32
    else:
        model = tiny_llama(dtype=dtype)
        eager = copy.deepcopy(model)
        args, dynamic = example_inputs(model.cfg, seq_len=8)
        exe = kiln.compile(model, args, dynamic_shapes=dynamic)
    vocab = model.cfg.vocab_size
    pos = 0
    for step_len in (11, 3, 1, 1, 1, 5):  # prefills of several lengths, then decode steps
        tokens = torch.randint(0, vocab, (1, step_len))
        input_pos = torch.arange(pos, pos + step_len)
        out, ref = exe(tokens, input_pos), eager(tokens, input_pos)
        assert out.dtype == ref.dtype == dtype
        assert rel_err(out, ref) <= tol, (step_len, rel_err(out, ref))
        pos += step_len
    # The compiled module updated the model's own KV cache in place, exactly as eager did.
    for a, b in zip(model.buffers(), eager.buffers()):
        assert rel_err(a, b) <= tol


@pytest.mark.parametrize("prompt_len", [1, 2, 17, 128])
def test_prefill_lengths_across_bounds(prompt_len, compiled_fp32):
    model, eager, exe = compiled_fp32
    tokens = torch.randint(0, model.cfg.vocab_size, (1, prompt_len))
    input_pos = torch.arange(prompt_len)
    assert rel_err(exe(tokens, input_pos), eager(tokens, input_pos)) <= 1e-5


def test_kv_cache_written_in_place(compiled_fp32):
    """The cache update is a scatter into the state, not a copy of the whole cache."""
    model, _, exe = compiled_fp32
    assert exe.plan.state_writes == {}
    inplace = [r for r in exe.plan.regions if r.inplace]
    assert len(inplace) == 2 * model.cfg.n_layers
