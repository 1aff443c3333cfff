"""Pipeline-parallel (and TP x PP) modules on CPU processes joined by gloo, against one
device: stages send activations with p2p and the last broadcasts the outputs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import rel_err
from tests.parallel.spmd import run_spmd

pytestmark = pytest.mark.filterwarnings("ignore")


def _staged(rank, world, tp, pp, overrides, pins):
    import kiln
    from kiln.models.llama import example_inputs, tiny_llama

    model, eager = tiny_llama(**overrides), tiny_llama(**overrides)
    args, ds = example_inputs(model.cfg, seq_len=5)
    module = kiln.compile(model, args, dynamic_shapes=ds, parallel={"tp": tp, "pp": pp},
                          pins=pins)
    errs, pos = [], 0
    torch.manual_seed(1)
    for length in (5, 3, 1, 1):  # prefills of two lengths, then decode steps
        tokens = torch.randint(0, model.cfg.vocab_size, (1, length))
        input_pos = torch.arange(pos, pos + length)
        with torch.no_grad():
            errs.append(rel_err(module(tokens, input_pos), eager(tokens, input_pos)))
        pos += length
    return max(errs), sorted(module.state)


@pytest.mark.parametrize("tp,pp,layers", [(1, 2, 2), (1, 4, 4), (2, 2, 2)])
def test_tiny_llama_pipeline_matches_one_device(tp, pp, layers):
    out = run_spmd(_staged, tp * pp, tp, pp, {"n_layers": layers}, None, timeout=300)
    for err, _ in out:
        assert err <= 1e-5
    last_stage = out[-1][1]
    assert "lm_head.weight" in last_stage and "model.embed_tokens.weight" in out[0][1]
    assert "lm_head.weight" not in out[0][1]  # stage 0 holds no head


def test_pinned_rotary_table_is_cloned_to_both_stages():
    """The seed case of DESIGN.md failure 2: a PP2 Llama whose 128 x 32 rotary table is
    pinned to device 0 and read by layers on devices 0 and 1."""
    out = run_spmd(_staged, 2, 1, 2, {"dim": 128}, {"rope_cos": 0, "rope_sin": 0},
                   timeout=300)
    for err, held in out:
        assert err <= 1e-5
        assert "rope_cos" in held and "rope_sin" in held  # a copy on each stage


def test_a_stage_receives_its_inputs_and_holds_its_clone_of_a_pinned_table():
    import kiln
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama()
    args, ds = example_inputs(model.cfg)
    kg = kiln.compile(model, args, dynamic_shapes=ds, compile_to="parallel",
                      parallel={"pp": 2, "rank": 1}, pins={"rope_cos": 0})
    assert [s.kind for s in kg.inputs].count("recv") >= 1
    assert tuple(kg.state["rope_cos"].shape) == (128, 16)


def _save_then_load(rank, world, path):
    import torch.distributed as dist

    import kiln
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama()
    args, ds = example_inputs(model.cfg, seq_len=4)
    module = kiln.compile(model, args, dynamic_shapes=ds, parallel={"pp": world})
    want = module(*args)
    module.save(path)
    dist.barrier()
    loaded = kiln.load(path)
    return rel_err(loaded(*args), want), loaded.parallel.pp_rank, sorted(loaded.state)


def test_save_and_load_a_pipeline_module_per_stage(tmp_path):
    out = run_spmd(_save_then_load, 2, str(tmp_path / "pp2.kiln"), timeout=300)
    assert [o[1] for o in out] == [0, 1]
    assert all(err <= 1e-6 for err, _, _ in out)
    assert "lm_head.weight" in out[1][2] and "lm_head.weight" not in out[0][2]
