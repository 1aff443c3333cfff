"""kiln.models.load(..., tensor_parallel_size=2 or pipeline_parallel_size=2) on every
rank of a gloo world: each rank reads only its slices (or its stage's weights) of the
checkpoint and generates what one device does."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import rel_err
from tests.parallel.spmd import run_spmd

pytestmark = pytest.mark.filterwarnings("ignore")


def _load_and_generate(rank, world, path, prompt, steps):
    """TP2, then PP2 on the same two processes: logits, greedy tokens, weights held."""
    import kiln.models
    from tests.models.support import run_alone

    out = []
    for tp, pp in ((world, 1), (1, world)):
        llm = kiln.models.load(path, dtype=torch.float32, tensor_parallel_size=tp,
                               pipeline_parallel_size=pp)
        logits = run_alone(llm, torch.tensor(prompt), torch.tensor(steps))
        params = dict(llm.model.named_parameters(remove_duplicate=False))
        weights = {n: t for m in (llm.prefill_module, llm.decode_module)
                   for n, t in m.state.items() if n in params}
        held = sum(t.numel() for t in weights.values())
        out.append((logits, llm.generate(prompt, max_new_tokens=6).ids, held))
    return out


# Mistral's sliding window under PP4 is test_transformers_plans' (CI time: each family here
# is ~45 s of two cores)
@pytest.mark.parametrize("family", ["llama3.1", "qwen2", "qwen3"])
def test_tp2_and_pp2_llms_from_a_checkpoint_match_one_device(family, checkpoints, llms):
    from tests.models.support import run_alone

    path, hf_model = checkpoints[family]
    prompt, steps = [1, 5, 9, 13, 2, 7, 30], [4, 8, 15]
    single = llms(family)
    want = run_alone(single, torch.tensor(prompt), torch.tensor(steps))
    want_tokens = single.generate(prompt, max_new_tokens=6).ids
    full = sum(p.numel() for p in hf_model.parameters())
    for plans in run_spmd(_load_and_generate, 2, str(path), prompt, steps, timeout=400):
        for logits, tokens, held in plans:
            assert max(rel_err(a, b) for a, b in zip(logits, want)) <= 1e-5
            assert tokens == want_tokens
            assert held < 0.6 * full  # its slices (or its stage) and the norms, no more


GENERATE = ["generate", "--random-weights", "--config", "tiny", "--prompt", "hello",
            "--max-new-tokens", "6"]


def test_cli_generate_spawns_its_ranks(capsys):
    """`kiln generate -tp 2 -pp 2` outside torchrun (a fresh process) starts the other
    three ranks itself, and prints what one device prints (here, in this process)."""
    import os
    import subprocess
    import sys

    from kiln.cli import main

    cmd = [sys.executable, "-c", "import sys; from kiln.cli import main; sys.exit(main())",
           *GENERATE, "-tp", "2", "-pp", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert main(GENERATE) == 0
    assert done.stdout == capsys.readouterr().out


def _load_prefill(rank, world, path, prompt):
    import kiln.models
    from tests.models.support import run_alone

    llm = kiln.models.load(path, dtype=torch.float32, tensor_parallel_size=world)
    head = llm.decode_module.state["lm_head.weight"]
    return run_alone(llm, torch.tensor(prompt), torch.tensor([], dtype=torch.long)), \
        tuple(head.shape), float(head[-1].abs().sum())


def test_tp2_reads_a_vocabulary_2_does_not_divide_and_pads_it(tmp_path):
    """97 rows over 2 ranks: each holds 49, the last rank's 49th a zero row no
    checkpoint has (vocab_padding.py); the logits are the transformers model's."""
    from tests.models.support import make_checkpoint

    hf = make_checkpoint(tmp_path / "llama", "llama3.1", vocab_size=97)
    prompt = [1, 5, 9, 13, 2]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    out = run_spmd(_load_prefill, 2, str(tmp_path / "llama"), prompt, timeout=400)
    for logits, shape, _ in out:
        assert rel_err(logits[0], want) <= 1e-5
        assert shape == (49, hf.config.hidden_size)
    assert out[1][2] == 0.0 and out[0][2] > 0


def test_a_second_spawned_load_while_the_first_is_open_is_refused(monkeypatch, tmp_path):
    """A multi-device LLM whose ranks this process spawned keeps them waiting on its
    calls: a second multi-device load here joined their world as a rank and hung. It
    is refused at once, saying to close the first."""
    import kiln.models
    from kiln.errors import ArgumentError
    from kiln.models import spawn

    monkeypatch.setattr(spawn, "_open", [object()])
    with pytest.raises(ArgumentError, match="still open") as e:
        kiln.models.load(str(tmp_path), tensor_parallel_size=2)
    assert ".close()" in e.value.hint


def test_a_spawned_llm_is_open_until_closed():
    from kiln.models import spawn

    llm = spawn.SpawnedLLM(object(), None, [], {})  # no ranks: the bookkeeping alone
    assert spawn.open_world() is llm
    llm.close()
    assert spawn.open_world() is None
    llm.close()  # twice (atexit too): nothing left to do
