"""Tensor parallelism derived from the graph: each rank's plan, in one process.

The runs across processes (gloo) are in test_tp_runs.py; here a rank's program is
built with parallel={"tp": T, "rank": r} and inspected: which weights each rank holds,
which collectives it runs, and the errors a user sees.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch

import kiln
from kiln.errors import ArgumentError, ShapeError
from kiln.models.llama import PRESETS, Llama, example_inputs, tiny_llama
from tests.parallel.gpt_fast_model import gpt_fast


def _rank_graph(model, args, ds, tp, rank):
    return kiln.compile(model, args, dynamic_shapes=ds, compile_to="parallel",
                        parallel={"tp": tp, "rank": rank})


def _collectives(kg) -> collections.Counter:
    return collections.Counter(str(n.target).split(".")[1] for n in kg.graph.nodes
                               if str(n.target).startswith("kiln."))


def _placeholder_shapes(kg) -> dict[str, tuple]:
    return {i.target: tuple(n.meta["val"].shape) for i, n in
            zip(kg.inputs, (n for n in kg.graph.nodes if n.op == "placeholder"))
            if i.target is not None}


@pytest.mark.parametrize("tp", [2, 4])
def test_llama_is_cut_the_megatron_way(tp):
    model = tiny_llama()
    cfg = model.cfg
    args, ds = example_inputs(cfg)
    kg = _rank_graph(model, args, ds, tp, rank=tp - 1)
    shapes = _placeholder_shapes(kg)
    hd = cfg.head_dim
    layer = "model.layers.0."
    assert shapes[layer + "self_attn.q_proj.weight"] == (cfg.n_heads * hd // tp, cfg.dim)
    kv_heads = max(cfg.n_kv_heads // tp, 1)  # TP4 over 2 KV heads: pairs of ranks share one
    assert shapes[layer + "self_attn.k_proj.weight"] == (kv_heads * hd, cfg.dim)
    assert shapes[layer + "self_attn.o_proj.weight"] == (cfg.dim, cfg.n_heads * hd // tp)
    assert shapes[layer + "mlp.gate_proj.weight"] == (cfg.intermediate_size // tp, cfg.dim)
    assert shapes[layer + "mlp.down_proj.weight"] == (cfg.dim, cfg.intermediate_size // tp)
    assert shapes[layer + "input_layernorm.weight"] == (cfg.dim,)
    assert shapes["model.embed_tokens.weight"] == (cfg.vocab_size // tp, cfg.dim)
    assert shapes["lm_head.weight"] == (cfg.vocab_size // tp, cfg.dim)
    assert shapes[layer + "self_attn.kv_cache.k_cache"][2] == kv_heads
    # one all-reduce after the embedding and after each row-parallel matmul; the
    # vocab-parallel logits gathered once
    assert _collectives(kg) == {"all_reduce": 1 + 2 * cfg.n_layers, "all_gather": 1}


def test_rank_slices_hold_the_right_rows():
    model = tiny_llama()
    args, ds = example_inputs(model.cfg)
    kg = _rank_graph(model, args, ds, 4, rank=3)
    full_q = model.model.layers[1].self_attn.q_proj.weight
    rows = full_q.shape[0] // 4
    assert torch.equal(kg.state["model.layers.1.self_attn.q_proj.weight"], full_q[3 * rows:])
    full_k = model.model.layers[1].self_attn.k_proj.weight  # 2 KV heads over 4 ranks
    assert torch.equal(kg.state["model.layers.1.self_attn.k_proj.weight"],
                       full_k[full_k.shape[0] // 2:])


def test_fused_projections_are_cut_per_segment():
    """gpt-fast's wqkv holds q, k and v: each rank takes its block of each, so the
    split in forward stays local and no activation is gathered inside a layer."""
    model = gpt_fast()
    T = torch.export.Dim("seq", min=1, max=32)
    args = (torch.randint(0, 128, (1, 6)), torch.arange(6))
    kg = _rank_graph(model, args, ({1: T}, {0: T}), 2, rank=1)
    wqkv = kg.state["layers.0.wqkv.weight"]
    full = model.layers[0].wqkv.weight
    q, k, v = full.split([64, 32, 32])
    assert torch.equal(wqkv, torch.cat([q[32:], k[16:], v[16:]]))
    w13 = kg.state["layers.0.w13.weight"]
    gate, up = model.layers[0].w13.weight.chunk(2)
    assert torch.equal(w13, torch.cat([gate[48:], up[48:]]))
    assert _collectives(kg) == {"all_reduce": 5, "all_gather": 1}


def test_a_fused_wqkv_with_fewer_kv_heads_than_ranks_still_cuts():
    """TP4 of gpt-fast's wqkv with 2 KV heads: the fused weight is cut as finely as
    k and v allow (2 parts), and each rank slices its own q head out of its half
    locally instead of the plan being refused."""
    model = gpt_fast()
    T = torch.export.Dim("seq", min=1, max=32)
    args = (torch.randint(0, 128, (1, 6)), torch.arange(6))
    kg = _rank_graph(model, args, ({1: T}, {0: T}), 4, rank=3)
    q, k, v = model.layers[0].wqkv.weight.split([64, 32, 32])
    assert torch.equal(kg.state["layers.0.wqkv.weight"], torch.cat([q[32:], k[16:], v[16:]]))
    assert kg.state["layers.0.w13.weight"].shape[0] == 2 * 96 // 4
    assert _collectives(kg) == {"all_reduce": 5, "all_gather": 1}


@pytest.mark.parametrize("overrides,tp,match", [
    ({}, 3, "4 .heads or width. is not divisible by 3"),
    ({"intermediate_size": 170}, 4, "170 .heads or width. is not divisible by 4"),
    ({}, 8, "the 4 query heads"),
])
def test_tp_that_does_not_divide_is_a_clear_error(overrides, tp, match):
    model = tiny_llama(**overrides)
    args, ds = example_inputs(model.cfg)
    with pytest.raises(ShapeError, match=match) as info:
        _rank_graph(model, args, ds, tp, rank=0)
    assert "llama.py" in str(info.value)  # the user's source line


@pytest.mark.parametrize("spec,match", [
    ({"tp": 0}, "positive int"), ({"tp": 2, "rank": 2}, "outside the 2 ranks"),
    ({"tq": 2}, "unknown keys"), ({"pp": 2, "pp_split": [1]}, "2 positive layer counts"),
])
def test_bad_parallel_spec(spec, match):
    model = tiny_llama()
    args, ds = example_inputs(model.cfg)
    with pytest.raises(ArgumentError, match=match):
        kiln.compile(model, args, dynamic_shapes=ds, parallel=spec)


def _llama70b(layers):
    cfg = PRESETS["llama2-70b"].with_(n_layers=layers, max_seq_len=2048)
    with torch.device("meta"):  # shapes only
        model = Llama(cfg).to(torch.float16)
        model.setup_cache(dtype=torch.float16, paged=True, block_size=16)
    args = (torch.zeros(1, 2048, dtype=torch.long, device="meta"),
            torch.arange(2048, device="meta"),
            torch.zeros(1, 128, dtype=torch.long, device="meta"))
    return model, args


def test_llama2_70b_tp8_plan_per_rank_is_an_eighth():
    model, args = _llama70b(layers=2)
    kg = kiln.compile(model, args, target="cuda:sm_90", compile_to="parallel",
                      parallel={"tp": 8, "rank": 5})
    shapes = _placeholder_shapes(kg)
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (1024, 8192)
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (128, 8192)  # 1 of 8 KV heads
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (8192, 3584)
    assert shapes["lm_head.weight"] == (4000, 8192)
    assert _collectives(kg) == {"all_reduce": 5, "all_gather": 1}


def test_tp8_plan_time_grows_linearly_with_layers():
    """The propagation visits each op once (a cut weight never reopens), so doubling
    the layers doubles the parallel stage's time, never squares it."""
    def stage_time(layers):  # CPU time: other processes on CI's cores do not count
        model, args = _llama70b(layers)
        t0 = time.process_time()
        kiln.compile(model, args, target="cuda:sm_90", compile_to="parallel",
                     parallel={"tp": 8, "rank": 0})
        return time.process_time() - t0

    stage_time(2)  # warm caches
    small, large = stage_time(4), stage_time(16)
    assert large < 4 * small * 2.5, (small, large)


def test_explain_shows_a_ranks_weights_and_collectives():
    model, args = _llama70b(layers=2)
    module = kiln.compile(model, args, target="cuda:sm_90", parallel={"tp": 8, "rank": 3},
                          options={"tune": "none"})
    text = module.explain()
    assert "device: rank 3 of tp=8 x pp=1" in text
    assert "weights: 27 tensors (4 updated in place), 536 MiB" in text  # an eighth
    assert "regions: " in text
    assert "collectives: 6 (1 all_gather 125 MiB, 5 all_reduce 160 MiB per call; in " \
        "schedule order:)" in text
    assert text.count("all_reduce on 'tp', f16[1, 2048, 8192], 32 MiB") == 5
    assert "all_gather on 'tp', f16[1, 2048, 32000], 125 MiB at " in text


def test_a_global_size_left_in_a_view_is_caught(monkeypatch):
    """A planted kiln bug: view sizes left global. The rank's shapes are inferred again
    and checked, so it is a VerifierError naming the op, never a wrong program."""
    from kiln.errors import VerifierError
    from kiln.parallel import tensor_parallel

    monkeypatch.setattr(tensor_parallel._Rewriter, "local_args", lambda self, node, s: None)
    model = tiny_llama()
    args, ds = example_inputs(model.cfg)
    planted = r"\(aten.view.default\) with inconsistent local shapes"
    with pytest.raises(VerifierError, match=planted) as info:
        _rank_graph(model, args, ds, 2, rank=0)
    assert "llama.py" in str(info.value)
