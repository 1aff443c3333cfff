"""transformers-made Llama, Mistral and Qwen2 checkpoints under TP4, PP4 and TP2 x PP2
(TP8: test_tp_runs.py; TP2 and PP2: test_llm_tp.py) on a gloo world of 4 processes,
against the transformers model on one device (transformers_plans.py).

One world runs the plans in turn (each joins the same processes with its own groups).
Each rank compiles one module per plan and family, about 4 s of a core: CI runs each
plan once, the families taking turns (Qwen2's tied embedding and biases where ranks
cut them most), and KILN_RUN_SLOW=1 runs every family under every plan.
"""

from __future__ import annotations

import pytest

from tests.parallel.spmd import run_spmd
from tests.parallel.transformers_plans import FAMILIES, plan_errors, run_plans

pytestmark = pytest.mark.filterwarnings("ignore")


def _check(references, world, plans):
    paths = {f: path for f, (path, _, _) in references.items()}
    plan_errors(references, plans, run_spmd(run_plans, world, paths, plans, timeout=900))


def test_tp4_pp4_and_tp2_pp2_match_transformers(transformers_checkpoints):
    _check(transformers_checkpoints, 4,
           [("llama3.1", 4, 1), ("mistral", 1, 4), ("qwen2", 2, 2)])


@pytest.mark.slow
@pytest.mark.parametrize("world,plans", [(4, [(4, 1), (1, 4), (2, 2)]), (8, [(8, 1)])])
def test_every_family_under_every_plan(transformers_checkpoints, world, plans):
    _check(transformers_checkpoints, world, [(f, tp, pp) for f in FAMILIES for tp, pp in plans])
