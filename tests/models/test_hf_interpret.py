"""A transformers checkpoint run through kiln's generated Triton kernels (the `interpret`
target: Triton's interpreter, not torch ops) matches transformers: batched prefill at two
prompt lengths, batched decode, and greedy generation."""

import pytest
import torch

import kiln.models
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err
from tests.models.support import make_checkpoint, run_batched

FAMILY = "llama3.1"  # Llama 3.1 RoPE scaling, GQA, a sharded checkpoint


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """One layer of the tiny llama3.1 checkpoint, loaded for the interpret target."""
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("hf-interpret") / FAMILY
    hf_model = make_checkpoint(path, FAMILY, num_hidden_layers=1)
    llm = kiln.models.load(path, target="interpret", max_batch_size=2, dtype=torch.float32)
    return hf_model, llm


def test_every_region_runs_a_generated_kernel(interpreted):
    _, llm = interpreted
    for module in (llm.prefill_module, llm.decode_module):
        kernels = module.program.kplan.kernels
        kinds = {name: k.kind for name, k in kernels.items()}
        assert kinds and set(kinds.values()) == {"triton"}, kinds
    # the decode step's cache writes run in its attention (dispatch/fold_cache_writes):
    # the batch's rows at their own positions (prompts of 5 and 11 below)
    (attention,) = [r for r in llm.decode_module.program.plan.regions
                    if r.kind == RegionKind.ATTENTION]
    assert len(attention.outputs) == 3 and len(attention.inplace) == 2


def test_batched_prefill_and_decode_match_transformers(interpreted):
    """Batch 2, prompts of 5 and 11 tokens (the short one right-padded), 3 decode steps."""
    hf_model, llm = interpreted
    vocab = llm.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (n,)) for n in (5, 11)]
    steps = torch.randint(3, vocab, (2, 3))
    outs = run_batched(llm, prompts, steps)
    for prompt, step, out in zip(prompts, steps, outs):
        tokens = torch.cat([prompt, step])[None]
        with torch.no_grad():
            ref = hf_model(tokens).logits[0, len(prompt) - 1:]
        assert out.shape == ref.shape
        assert rel_err(out, ref) <= 1e-4, (len(prompt), rel_err(out, ref))


def test_greedy_generation_matches_transformers(interpreted):
    hf_model, llm = interpreted
    prompts = [[5, 17, 42, 8, 60], [33, 9, 71, 24, 50, 12, 88, 40, 19, 66, 7]]
    ours = llm.generate(prompts, max_new_tokens=12, ignore_eos=True)
    for prompt, out in zip(prompts, ours):
        ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12,
                                do_sample=False)[0, len(prompt):].tolist()
        assert len(set(ref)) >= 8, f"a reference of few distinct tokens tests little: {ref}"
        assert out.ids == ref
