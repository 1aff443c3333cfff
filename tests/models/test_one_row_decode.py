"""A lone sequence decodes with GEMVs when the LLM batches more: kiln.compile gives the
decode module a narrow version for one row (kiln/dispatch/narrow_rows.py), since 16-bit
products of several rows take the tiled form, which a batch-bounded decode module would
run at one row too. On the interpret target (generated kernels): which LLMs get it, its
kernels, its logits against transformers and against the batched module, and a saved
LLM keeping it."""

import pytest
import torch

import kiln.models
from tests.helpers import rel_err
from tests.models.support import make_checkpoint, run_alone, run_batched


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("one-row") / "llama3.1"
    return path, make_checkpoint(path, "llama3.1", num_hidden_layers=1)


def _kernel_names(program):
    return [getattr(getattr(k, "spec", None), "name", "") for k in
            program.kplan.kernels.values()]


def test_one_row_runs_gemvs_and_matches_transformers_and_the_batch(checkpoint, tmp_path):
    path, hf_model = checkpoint
    llm = kiln.models.load(path, target="interpret", max_batch_size=2, dtype=torch.float16)
    decode = llm.decode_module.program
    assert decode.narrow is not None and decode.narrow.hi == 1
    assert decode.plan.dim_names[decode.narrow.symbol] == "batch"
    # torch gives the batch Dim two symbols here: both narrowed
    assert all(b.hi == 1 for n, b in decode.narrow.program.plan.symbols.items()
               if decode.plan.dim_names.get(n) == "batch")
    one, many = _kernel_names(decode.narrow.program), _kernel_names(decode)
    assert any("gemv" in n for n in one) and not any("gemv" in n for n in many)
    assert llm.prefill_module.program.narrow is None  # T >= 2; the LM head alone is not worth it
    vocab = llm.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt, steps = torch.randint(3, vocab, (6,), generator=gen), torch.randint(3, vocab, (3,),
                                                                               generator=gen)
    alone = run_alone(llm, prompt, steps)
    with torch.no_grad():
        ref = hf_model(torch.cat([prompt, steps])[None]).logits[0, len(prompt) - 1:]
    assert rel_err(alone.float(), ref) <= 1e-2
    # two rows run the batched plan; each row as it runs alone
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in (5, 9)]
    more = torch.randint(3, vocab, (2, 3), generator=gen)
    batched = run_batched(llm, prompts, more)
    for i, p in enumerate(prompts):
        assert rel_err(batched[i].float(), run_alone(llm, p, more[i]).float()) <= 1e-2, i
    llm.save(tmp_path / "saved")
    loaded = kiln.models.load(tmp_path / "saved")
    assert loaded.decode_module.program.narrow is not None
    assert rel_err(run_alone(loaded, prompt, steps).float(), alone.float()) <= 1e-6


def test_only_where_batching_leaves_the_gemv_form(checkpoint):
    path, _ = checkpoint
    # fp32 keeps GEMVs up to 8 rows; one row needs no second plan; the CPU target's
    # products are torch's
    for kw in ({"dtype": torch.float32, "max_batch_size": 2, "target": "interpret"},
               {"dtype": torch.float16, "max_batch_size": 1, "target": "interpret"},
               {"dtype": torch.float32, "max_batch_size": 2, "target": "cpu"}):
        llm = kiln.models.load(path, **kw)
        assert all(m.program.narrow is None for m in llm.modules()), kw
