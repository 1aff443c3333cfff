"""Pipeline stages compiled one rank at a time in one process, chained by hand.

Each stage's Program runs with the values the earlier stages sent; the last stage's
logits and every stage's KV cache must match the single-device eager model.
"""

import json
import re

import pytest
import torch

import kiln
from kiln.api import build_pipeline
from kiln.errors import ArgumentError
from kiln.frontend.import_pass import ModelSource
from kiln.models.llama import example_inputs, tiny_llama
from kiln.parallel.config import ParallelConfig
from kiln.parallel.pipeline_stages import split_layers
from kiln.pipeline import Context
from kiln.runtime.state import state_for_target
from kiln.target import get_target
from tests.helpers import rel_err


def compile_stage(model, args, ds, cfg: ParallelConfig, compile_to=None, kwargs=None):
    pm = build_pipeline()  # the parallel stage runs pipeline_stages first
    tgt = get_target("cpu")
    ctx = Context(target=tgt, options={"parallel": cfg})
    out = pm.run(ModelSource(model, args, kwargs or {}, ds), ctx, compile_to=compile_to)
    if compile_to is not None:
        return out
    return out, state_for_target(out, ctx.options["state"], tgt)


def run_chain(stages, args):
    """Run every stage in order, as p2p would: stage a's sends to stage d, in plan.send
    order, are d's receives from a, in plan.recv order (a FIFO per pair of stages)."""
    queues: dict[tuple[int, int], list[torch.Tensor]] = {}
    outputs = None
    for s, (prog, state) in enumerate(stages):
        received = [queues[(src, s)].pop(0) for _, src in prog.plan.recv]
        outputs, sent = prog.run_stage(list(args), received, state)
        for (_, dsts), value in zip(prog.plan.send, sent):
            for d in dsts:
                queues.setdefault((s, d), []).append(value)
        if s < len(stages) - 1:
            assert outputs == []
    assert not any(queues.values())  # every value sent was received
    return outputs


def compile_stages(layers: int, pp: int, tied: bool = False):
    """The tiny Llama's `pp` stages, each compiled as its rank would."""
    model = tiny_llama(n_layers=layers, tie_word_embeddings=tied)
    args, ds = example_inputs(model.cfg, 6)
    return model, [compile_stage(model, args, ds, ParallelConfig(pp=pp, rank=r))
                   for r in range(pp)]


@pytest.fixture(scope="module")
def two_stages():
    """The default tiny Llama (2 layers) as PP2, compiled once for the tests that read
    it: the chained run (which only fills its KV caches) and the plan's explain/save."""
    return compile_stages(2, 2)


@pytest.mark.parametrize("layers,pp,tied", [(2, 2, False), (4, 4, False), (2, 2, True)])
def test_pipeline_stages_match_single_device(layers, pp, tied, request):
    ref = tiny_llama(n_layers=layers, tie_word_embeddings=tied)
    reused = (layers, pp, tied) == (2, 2, False)
    model, stages = request.getfixturevalue("two_stages") if reused else \
        compile_stages(layers, pp, tied)
    caches = [dict(state) for _, state in stages]
    if tied:  # the embedding is the LM head too: the last stage holds its own copy
        shared = set(caches[0]) & set(caches[-1])
        assert len(shared - {"rope_cos", "rope_sin"}) == 1, shared
    gen = torch.Generator().manual_seed(3)
    pos = 0
    for n in (6, 3, 1):  # two prefills of different lengths, then a decode step
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        input_pos = torch.arange(pos, pos + n)
        pos += n
        with torch.no_grad():
            want = ref(tokens, input_pos)
        (got,) = run_chain(stages, (tokens, input_pos))
        assert rel_err(got, want) <= 1e-5, (n, rel_err(got, want))
        buffers = dict(ref.named_buffers())
        for state in caches:
            held = [k for k in state if "kv_cache" in k]
            assert held
            for k in held:
                assert rel_err(state[k], buffers[k]) <= 1e-5, (n, k)
    held = [{k for k in s if "kv_cache" in k} for s in caches]
    assert sum(len(h) for h in held) == len(set().union(*held)) == 2 * layers


def test_stage_weights_are_disjoint_except_floating_buffers():
    model = tiny_llama(n_layers=4)
    args, ds = example_inputs(model.cfg, 4)
    graphs = [compile_stage(model, args, ds, ParallelConfig(pp=2, rank=r), "parallel")
              for r in range(2)]
    first, second = (set(g.state) for g in graphs)
    assert first & second == {"rope_cos", "rope_sin"}  # each stage holds its own table copy
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in second
    assert {k.split(".")[2] for k in first if k.startswith("model.layers.")} == {"0", "1"}
    io = graphs[0].stage_io
    assert io.layers == [["model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3"]]
    assert graphs[0].stage_io.send and not graphs[0].stage_io.recv
    assert [n for n, _ in graphs[1].stage_io.recv] == [f"recv_{n}" for n, _ in io.send]
    assert all(s == 0 for _, s in graphs[1].stage_io.recv)
    assert not [o for o in graphs[0].outputs if o.kind == "user"]
    assert [o.kind for o in graphs[1].outputs].count("user") == 1


def test_split_balances_bytes_and_pp_split_overrides():
    assert split_layers([10, 10, 10, 30], 2) == [3, 1]
    assert split_layers([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    assert split_layers([50, 1, 1, 1, 1, 50], 3) == [1, 4, 1]
    model = tiny_llama(n_layers=4)
    args, ds = example_inputs(model.cfg, 4)
    kg = compile_stage(model, args, ds, ParallelConfig(pp=2, rank=0, pp_split=(1, 3)), "parallel")
    assert kg.stage_io.layers == [["model.layers.0"], ["model.layers.1", "model.layers.2",
                                                        "model.layers.3"]]
    assert kg.stage_io.weight_bytes[0] < kg.stage_io.weight_bytes[1]


def test_more_stages_than_layers_is_an_argument_error():
    model = tiny_llama()
    args, ds = example_inputs(model.cfg, 4)
    with pytest.raises(ArgumentError, match="at least 3 layers, the model has 2") as e:
        compile_stage(model, args, ds, ParallelConfig(pp=3, rank=0), "parallel")
    assert "pp=2" in e.value.hint


def test_a_transformers_llama_splits_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 5))
    seq = torch.export.Dim("seq", min=2, max=32)
    ds = {"input_ids": {1: seq}, "use_cache": None}
    stages = [compile_stage(hf, (ids,), ds, ParallelConfig(pp=2, rank=r), None,
                            {"use_cache": False}) for r in range(2)]
    first, second = (set(state) for _, state in stages)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in second
    assert not any(k.startswith("model.layers.1.") for k in first)
    assert not any(k.startswith("model.layers.0.") for k in second)
    for n in (5, 11):
        x = torch.randint(0, 128, (1, n))
        with torch.no_grad():
            want = hf(x, use_cache=False).logits
        (got,) = run_chain(stages, (x,))
        assert rel_err(got, want) <= 1e-5, (n, rel_err(got, want))


def test_stage_plan_explains_and_round_trips_through_an_artifact(tmp_path, two_stages):
    from kiln.artifact.manifest import plan_from_json, plan_to_json
    from kiln.compiled_module import CompiledModule

    model, stages = two_stages
    args, ds = example_inputs(model.cfg, 4)
    first, second = (prog.plan for prog, _ in stages)
    text = CompiledModule(stages[0][0], stages[0][1]).explain()
    (name, dsts), = first.send[:1]
    assert re.search(rf"send %{name} f32\[1, \w+, 64\] to stage 1: ", text), text
    assert "recv %" in CompiledModule(stages[1][0], stages[1][1]).explain()
    for plan in (first, second):
        back = plan_from_json(json.loads(json.dumps(plan_to_json(plan))))
        assert (back.recv, back.send) == (plan.recv, plan.send)
    single = compile_stage(model, args, ds, ParallelConfig(), "dispatch")
    assert "recv" not in plan_to_json(single) and not single.recv and not single.send
    assert "pipeline stage" not in kiln.compile(model, args, dynamic_shapes=ds).explain()
    path = tmp_path / "stage1"
    CompiledModule(stages[1][0], stages[1][1]).save(path)
    loaded = kiln.load(path)
    assert (loaded.program.plan.recv, loaded.program.plan.send) == (second.recv, second.send)


def test_deepseek_layers_split_even_where_weights_are_read_before_the_embedding(tmp_path):
    """DeepSeek-V3's absorbed W_UK / W_UV are weights a prefill never reads (it takes the
    expanded form): they once placed every layer's first use before the embedding's, so
    the embedding joined the last stage and stage 0 held nothing."""
    from kiln.models import deepseek_v3_checkpoint as ds
    from tests.models.test_deepseek_v3 import make_hf_model

    make_hf_model(num_hidden_layers=4).save_pretrained(tmp_path)
    model, _ = ds.load_checkpoint(tmp_path, torch.float32, "cpu", max_seq_len=32)
    ref, _ = ds.load_checkpoint(tmp_path, torch.float32, "cpu", max_seq_len=32)
    tokens = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    args = (tokens, torch.arange(5)[None])
    stages = [compile_stage(model, args, None, ParallelConfig(pp=2, rank=r)) for r in range(2)]
    first = {k.split(".")[2] for k in stages[0][1] if k.startswith("model.layers.")}
    assert first == {"0", "1"} and "model.embed_tokens.weight" in stages[0][1]
    with torch.no_grad():
        want = ref(*args)
    (got,) = run_chain(stages, args)
    assert rel_err(got, want) <= 1e-5
