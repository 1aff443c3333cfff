"""transformers-made Llama, Mistral and Qwen2 checkpoints under multi-device plans,
against the transformers model on one device (test_transformers_plans.py; the TP8
run shares test_tp_runs.py's world of 8 processes).

Every rank reads the checkpoint into kiln's model and compiles one module per plan
(dynamic length: prefills and decode steps alike): two prefills of different lengths,
decode steps and greedy decoding must match transformers on every rank: the same
tokens, and every call's logits within 1e-5 (fp32), the greedy steps' included.
8 query heads over 2 KV heads, so TP4 and TP8 replicate KV heads; 4 layers, so PP4
has a layer per stage.
"""

from __future__ import annotations

import torch

from tests.helpers import rel_err

FAMILIES = ("llama3.1", "mistral", "qwen2")
PROMPT, MORE, STEPS = [1, 5, 9, 13, 2, 7, 30], [11, 3, 44], [4, 8, 15]  # prefill, prefill, decode
GREEDY = 6


def make_references(root) -> dict:
    """family -> (checkpoint dir, transformers' logits of the sequence and of its greedy
    continuation, that continuation)."""
    from tests.models.support import make_checkpoint

    out = {}
    seq = torch.tensor([PROMPT + MORE + STEPS])
    for family in FAMILIES:
        hf = make_checkpoint(root / family, family, num_attention_heads=8,
                             num_key_value_heads=2, num_hidden_layers=4)
        with torch.no_grad():
            whole = hf.generate(seq, max_new_tokens=GREEDY, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
            logits = hf(whole[:, :-1]).logits[0]  # each call's rows, greedy steps too
        out[family] = (str(root / family), logits, whole[0, seq.shape[1]:].tolist())
    return out


def run_plans(rank, world, paths, plans):
    """On one rank, per (family, tp, pp): the logits of every call, and greedy tokens."""
    import kiln
    from kiln.models import hf
    from kiln.models.llama import example_inputs

    out = {}
    for family, tp, pp in plans:
        model, _ = hf.load_checkpoint(paths[family], torch.float32, "cpu", max_seq_len=64)
        model.setup_cache()
        args, ds = example_inputs(model.cfg, seq_len=5)
        module = kiln.compile(model, args, dynamic_shapes=ds, parallel={"tp": tp, "pp": pp})
        logits, pos = [], 0
        for ids in (PROMPT, MORE, *([s] for s in STEPS)):
            with torch.no_grad():
                logits.append(module(torch.tensor([ids]), torch.arange(pos, pos + len(ids)))[0])
            pos += len(ids)
        tokens = []
        for _ in range(GREEDY):  # greedy from where the sequence ends
            tokens.append(int(logits[-1][-1].argmax()))
            with torch.no_grad():
                logits.append(module(torch.tensor([[tokens[-1]]]), torch.tensor([pos]))[0])
            pos += 1
        out[family, tp, pp] = torch.cat(logits[:-1]), tokens
    return out


def plan_errors(references, plans, outputs) -> dict:
    """(family, tp, pp) -> the worst rank's relative error; fails on a rank that differs
    from transformers (fp32, 1e-5) or whose greedy tokens do."""
    worst = {}
    for rank_out in outputs:
        assert sorted(rank_out) == sorted(plans)
        for (family, tp, pp), (logits, tokens) in rank_out.items():
            _, want, greedy = references[family]
            assert tokens == greedy, (family, tp, pp, tokens, greedy)
            err = rel_err(logits, want)
            assert err <= 1e-5, (family, tp, pp, err)
            worst[family, tp, pp] = max(err, worst.get((family, tp, pp), 0.0))
    return worst
