"""The compile cache over tensors a pass derived from the model's (ir/derived.py): Meta's
complex RoPE, whose real pairs complex_products makes from the complex64 table, is kept
with the recipe instead of the pairs, and a hit makes them again from the model's own
table, so a model of the same program with another table gets its own pairs."""

import copy
import json

import pytest
import torch

import kiln
from kiln.artifact import compile_cache
from kiln.ir.derived import Derivation
from tests.frontend.meta_llama import ModelArgs, Transformer

pytestmark = pytest.mark.compile_cache

SHAPES = {"tokens": {1: kiln.Dim("seq", max=16)}, "start_pos": kiln.Dim("start", max=15)}
PAIRS = "kiln_folded.c_freqs_cis"  # the pairs' state name, after Meta's lifted table


class TitanTransformer(Transformer):
    """torchtitan's way: the complex table a persistent buffer the forward only reads,
    whose values (unlike a lifted constant's or a non-persistent buffer's, which
    torch.export keeps with the constants) are not in the compile cache key."""

    def __init__(self, params: ModelArgs):
        super().__init__(params)
        self.register_buffer("freqs_cis", self.__dict__.pop("freqs_cis"), persistent=True)

    @torch.inference_mode()
    def forward(self, tokens, start_pos: int):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        mask = torch.triu(torch.full((seqlen, seqlen), float("-inf")), diagonal=1)
        mask = torch.hstack([torch.zeros((seqlen, start_pos)), mask]).type_as(h)
        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, mask)
        return self.output(self.norm(h)).float()


def _model(cls=Transformer, theta=500000.0, seed=0):
    torch.manual_seed(seed)
    model = cls(ModelArgs(rope_theta=theta)).eval()
    return model, copy.deepcopy(model)  # the reference keeps a KV cache of its own


def _compile(model):
    # an example start of 2: torch.export fixes an int whose example is 0 or 1
    return kiln.compile(model, (torch.randint(0, 64, (1, 5)), 2), dynamic_shapes=SHAPES,
                        target="cpu")


def _hit(exe) -> bool:
    """Whether `exe` came from the cache: decomposition and passes never ran."""
    t = exe.compile_timings
    return "import/export/decompose" not in t and "compile_cache" in t


def _run(exe, ref) -> list[torch.Tensor]:
    """A prefill of 5 tokens and three decode steps, each checked against eager."""
    gen = torch.Generator().manual_seed(1)
    steps = [(torch.randint(0, 64, (1, 5), generator=gen), 0)]
    steps += [(torch.randint(0, 64, (1, 1), generator=gen), p) for p in (5, 6, 7)]
    outs = []
    for tokens, pos in steps:
        got, want = exe(tokens, pos), ref(tokens, pos)
        assert (got - want).abs().max().item() < 1e-5, pos
        outs.append(got)
    return outs


def _entries() -> list[dict]:
    root = compile_cache._root()
    return [json.loads((e / "manifest.json").read_text()) for e in root.iterdir()
            if (e / "manifest.json").is_file()]


def test_metas_llama_is_kept_and_hits():
    model, ref = _model()
    first = _compile(model)
    assert not _hit(first) and PAIRS in first.state
    _run(first, ref)
    (entry,) = _entries()
    assert entry["derived"] == {PAIRS: {"source": "freqs_cis", "steps": ["view_as_real"]}}
    assert PAIRS not in entry["stored"]["tensors"]  # the recipe is kept, not the pairs
    model, ref = _model(seed=1)  # same program, other weights
    again = _compile(model)
    assert _hit(again)
    _run(again, ref)


def test_another_table_behind_a_hit_gets_its_own_pairs():
    """A registered buffer's values are not in the key: the hit must remake the pairs."""
    model, ref = _model(TitanTransformer)
    before = _run(_compile(model), ref)
    other, other_ref = _model(TitanTransformer, theta=10000.0)
    exe = _compile(other)
    assert _hit(exe)
    assert torch.equal(exe.state[PAIRS.replace("c_", "b_")],
                       torch.view_as_real(other.freqs_cis))
    after = _run(exe, other_ref)
    assert (after[-1] - before[-1]).abs().max().item() > 1e-3  # stale pairs would show


def test_metas_lifted_table_with_other_values_is_another_program():
    model, ref = _model()
    _run(_compile(model), ref)
    other, other_ref = _model(theta=10000.0)
    exe = _compile(other)  # a lifted constant's values are in the key: compiled again
    assert not _hit(exe)
    _run(exe, other_ref)


def _unknown_step(manifest):
    for d in manifest["derived"].values():
        d["steps"] = ["exec"]


def _not_a_dict(manifest):
    manifest["derived"] = ["view_as_real"]


@pytest.mark.parametrize("spoil", [_unknown_step, _not_a_dict])
def test_an_entry_whose_recipes_kiln_cannot_read_is_a_miss(spoil):
    model, ref = _model(TitanTransformer)
    _compile(model)
    for entry in compile_cache._root().iterdir():
        path = entry / "manifest.json"
        manifest = json.loads(path.read_text())
        spoil(manifest)
        path.write_text(json.dumps(manifest))
    model, ref = _model(TitanTransformer, seed=2)
    exe = _compile(model)
    assert not _hit(exe)
    _run(exe, ref)


def test_a_recipe_is_kept_only_if_it_remakes_the_compiled_values():
    cis = torch.polar(torch.ones(6, 4), torch.randn(6, 4))
    d = Derivation("t", ("view_as_real",))
    captured = {"t": cis}
    state = {"t": cis, "p": d.apply(cis)}
    assert compile_cache._not_replayable("p", d, captured, dict(captured), state) == ""
    spoilt = {**state, "p": state["p"] * 2}  # a later pass changed the values
    assert "not what its recipe" in \
        compile_cache._not_replayable("p", d, captured, dict(captured), spoilt)
    other = {**state, "t": cis.clone()}  # the source is no longer the captured tensor
    assert "not the captured program's tensor" in \
        compile_cache._not_replayable("p", d, captured, dict(captured), other)
