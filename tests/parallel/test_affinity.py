"""The affinity analysis: a monotone fixed point that always converges, clones of
weights, transfers of activations, and contradictory pins (DESIGN.md failure 2)."""

from __future__ import annotations

import re

import pytest

import kiln
from kiln.errors import AffinityError, VerifierError
from kiln.models.llama import example_inputs, tiny_llama
from kiln.parallel.affinity import affinity
from kiln.parallel.lattice import solve


def test_a_long_chain_converges_in_one_visit_per_node():
    """IREE needed N sweeps for N chained ops and gave up at 32; a worklist in order
    visits each once."""
    n = 5000
    fp = solve(range(n), lambda i: [i - 1] if i else [],
               lambda i, v: v[i - 1] | {i % 7} if i else frozenset({0}), frozenset())
    assert fp.value[n - 1] == frozenset(range(7))
    assert fp.visits == n


def test_chains_in_the_wrong_order_still_converge_without_a_cap():
    n = 300
    fp = solve(reversed(range(n)), lambda i: [i - 1] if i else [],
               lambda i, v: v[i - 1] | {i % 5} if i else frozenset({0}), frozenset())
    assert fp.value[n - 1] == frozenset(range(5))
    assert fp.visits <= n * 6  # bounded by nodes x lattice height, never a cap


def test_diamonds_and_tied_values_reach_the_least_fixed_point():
    # 200 diamonds in series: a -> (b, c) -> d -> ...; plus a cycle of tied values
    # (x and y must hold the same set) fed by the last diamond
    reads = {}
    for k in range(200):
        a, b, c, d = (f"a{k}", f"b{k}", f"c{k}", f"a{k + 1}")
        reads[b], reads[c] = [a], [a]
        reads[d] = [b, c]
    reads["a0"] = []
    reads["x"], reads["y"] = ["a200", "y"], ["x"]
    seed = {"a0": {"dev0"}, "b7": {"dev1"}, "c99": {"dev2"}}

    def transfer(n, v):
        out = set(seed.get(n, ()))
        for m in reads[n]:
            out |= v[m]
        return frozenset(out)

    fp = solve(reads, lambda n: reads[n], transfer, frozenset())
    assert fp.value["x"] == fp.value["y"] == frozenset({"dev0", "dev1", "dev2"})
    assert fp.value["a5"] == frozenset({"dev0"})


def test_a_transfer_that_moves_down_is_a_kiln_bug():
    calls = {"n": 0}

    def shrinking(n, v):
        calls["n"] += 1
        return frozenset({1, 2}) if calls["n"] == 1 else frozenset({1})

    with pytest.raises(VerifierError, match="moved .* down its lattice"):
        solve(["a", "b"], lambda n: ["a"] if n == "b" else ["b"], shrinking, frozenset())


def _stage_of(name: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", name)
    if m:
        return int(m.group(1))
    if "embed" in name:
        return 0
    if "norm" in name or "lm_head" in name:
        return 1
    return None


def _pp2_placement(kg):
    """Layer 0 and the embedding on device 0, layer 1 and the head on device 1; an op
    reading nothing placed (positions, RoPE lookups, masks) is computed where needed."""
    target = {i.name: i.target for i in kg.inputs}
    place, stage = {}, {}
    for n in kg.graph.nodes:
        if n.op == "placeholder":
            stage[n] = _stage_of(target.get(n.name) or "") if "kv_cache" not in n.name \
                else _stage_of(target[n.name])
        elif n.op == "call_function":
            seen = [stage[a] for a in n.all_input_nodes if stage.get(a) is not None]
            stage[n] = max(seen) if seen else None
            place[n] = stage[n]
    return place


def _graph(**overrides):
    model = tiny_llama(**overrides)
    args, ds = example_inputs(model.cfg)
    return kiln.compile(model, args, dynamic_shapes=ds, compile_to="graph")


def test_pinned_rotary_table_used_on_two_devices_is_cloned():
    kg = _graph()
    result = affinity(kg, _pp2_placement(kg), pins={"rope_cos": 0})
    assert result.clones["rope_cos"] == frozenset({0, 1})  # cloned, not sent per call
    assert result.clones["rope_sin"] == frozenset({0, 1})
    assert "model.layers.1.self_attn.q_proj.weight" not in result.clones
    # the residual stream leaves device 0 once, for device 1
    crossing = {v: t for v, t in result.transfers.items()}
    assert crossing and all(t == (0, frozenset({1})) for t in crossing.values())
    assert len(crossing) <= 2


def test_tied_weights_pinned_to_two_devices_contradict():
    kg = _graph(tie_word_embeddings=True)
    with pytest.raises(AffinityError) as info:
        affinity(kg, _pp2_placement(kg),
                 pins={"model.embed_tokens.weight": 0, "lm_head.weight": 1})
    text = str(info.value)
    assert "pinned to devices [0, 1]" in text
    assert "model.embed_tokens.weight -> device 0" in text and "lm_head.weight -> device 1" in text
    assert "llama.py" in text and "embed_tokens(tokens)" in text  # where the model reads it
