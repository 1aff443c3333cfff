"""TP / PP outputs against one device, as a table (issue 9's closing evidence), on CPU
processes joined by gloo:

    PYTHONPATH=. python benchmarks/issue9_plan_errors.py

Plans TP2, TP4, TP8, PP2, PP4 and TP2 x PP2; models: kiln's tiny Llama (8 heads over 2
KV heads, 4 layers) against itself run eagerly, and transformers-made Llama 3.1,
Mistral and Qwen2 checkpoints (the same shape) against transformers. Each call sequence
is two prefills (7 and 3 tokens), three decode steps and six greedy steps; the error is
the worst relative error of the logits over every call (greedy steps too) and rank
(fp32), "greedy" whether every rank's greedy tokens equal the reference's. The tests
(tests/parallel/test_transformers_plans.py, test_tp_runs.py, test_pp_runs.py) assert
the same; this prints the numbers.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from tests.helpers import rel_err
from tests.parallel.spmd import run_spmd
from tests.parallel.transformers_plans import (
    FAMILIES,
    GREEDY,
    MORE,
    PROMPT,
    STEPS,
    make_references,
    plan_errors,
    run_plans,
)

WORLDS = {2: [(2, 1), (1, 2)], 4: [(4, 1), (1, 4), (2, 2)], 8: [(8, 1)]}
TINY = dict(n_heads=8, n_kv_heads=2, n_layers=4)


def _tiny(tp: int, pp: int):
    """kiln's tiny Llama under one plan against itself run eagerly: (error, greedy equal)."""
    import kiln
    from kiln.models.llama import example_inputs, tiny_llama

    model, eager = tiny_llama(**TINY), tiny_llama(**TINY)
    args, ds = example_inputs(model.cfg, seq_len=5)
    module = kiln.compile(model, args, dynamic_shapes=ds, parallel={"tp": tp, "pp": pp})
    errs, pos = [], 0
    for ids in (PROMPT, MORE, *([s] for s in STEPS)):
        x, p = torch.tensor([ids]), torch.arange(pos, pos + len(ids))
        with torch.no_grad():
            got, want = module(x, p), eager(x, p)
        errs.append(rel_err(got, want))
        pos += len(ids)
    ours, theirs = [], []
    for _ in range(GREEDY):  # both fed the module's token; eager's own choice compared
        ours.append(int(got[0, -1].argmax()))
        theirs.append(int(want[0, -1].argmax()))
        x, p = torch.tensor([[ours[-1]]]), torch.tensor([pos])
        with torch.no_grad():
            got, want = module(x, p), eager(x, p)
        errs.append(rel_err(got, want))
        pos += 1
    return max(errs), ours == theirs


def _world(rank, world, paths, plans):
    tiny = {(tp, pp): _tiny(tp, pp) for tp, pp in plans}
    return tiny, run_plans(rank, world, paths, [(f, tp, pp) for f in FAMILIES
                                                for tp, pp in plans])


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        refs = make_references(Path(d))
        paths = {f: path for f, (path, _, _) in refs.items()}
        rows = []
        for world, plans in WORLDS.items():
            out = run_spmd(_world, world, paths, plans, timeout=1800)
            for tp, pp in plans:
                errs = [o[0][tp, pp] for o in out]
                rows.append(("tiny Llama (kiln)", tp, pp, max(e for e, _ in errs),
                             all(g for _, g in errs)))
            hf = [(f, tp, pp) for f in FAMILIES for tp, pp in plans]
            worst = plan_errors(refs, hf, [o[1] for o in out])  # asserts greedy equality
            rows += [(f"{f} (transformers)", tp, pp, worst[f, tp, pp], True)
                     for f, tp, pp in hf]
    print("| model | plan | ranks | max rel err vs one device | greedy tokens identical |")
    print("|---|---|---|---|---|")
    for name, tp, pp, err, same in rows:
        plan = f"TP{tp}" if pp == 1 else f"PP{pp}" if tp == 1 else f"TP{tp} x PP{pp}"
        print(f"| {name} | {plan} | {tp * pp} | {err:.1e} | {same} |")


if __name__ == "__main__":
    main()
