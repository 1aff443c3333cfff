"""The graph stage as a whole, on the tiny Llama: nothing gets worse downstream."""

import copy

import torch

import kiln
import kiln.api
from kiln.graph import GRAPH_PASSES
from kiln.graph.dce import dce
from kiln.models.llama import example_inputs, tiny_llama
from tests.helpers import rel_err


def _compile(monkeypatch, passes, dtype):
    monkeypatch.setattr(kiln.api, "GRAPH_PASSES", passes)
    model = tiny_llama(dtype=dtype)
    args, dynamic = example_inputs(model.cfg, seq_len=5)
    return kiln.compile(model, args, dynamic_shapes=dynamic), model


def test_tiny_llama_plan_is_no_worse_than_without_graph_passes(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        plain, _ = _compile(monkeypatch, [dce], dtype)
        exe, model = _compile(monkeypatch, GRAPH_PASSES, dtype)
        eager = copy.deepcopy(model)
        assert len(exe.plan.regions) <= len(plain.plan.regions)
        # Fewer ops run: split/getitem became slices, view chains one view, and the views
        # around each SwiGLU activation cancelled.
        ops = sum(len(r.ops) for r in exe.plan.regions)
        assert ops < sum(len(r.ops) for r in plain.plan.regions)
        tokens = torch.randint(0, model.cfg.vocab_size, (1, 6))
        pos = torch.arange(6)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert rel_err(exe(tokens, pos), eager(tokens, pos)) <= tol
