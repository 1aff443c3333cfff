"""kiln.save_modules / kiln.load_modules: modules compiled from one model keep sharing its
weights and its updated buffers through a save and a load, stored once."""

import json

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open

import kiln
from kiln.artifact.weights import load_weights, save_shared_weights
from kiln.errors import ArgumentError, ArtifactError


class Core(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8), persistent=False)


class Writer(nn.Module):
    """Writes lin(x) into cache row `pos` (like a KV-cache update)."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, x, pos):
        self.core.cache[pos] = self.core.lin(x)
        return self.core.cache.sum(0)


class Reader(nn.Module):
    """Reads what the writer left (through x: a term of the cache alone would be folded)."""

    def __init__(self, core):
        super().__init__()
        self.core = core

    def forward(self, x):
        return (self.core.lin(x) * self.core.cache).sum(0)


X = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    core = Core().eval()
    writer = kiln.compile(Writer(core), (X, torch.tensor([0])))
    reader = kiln.compile(Reader(core), (X,))
    return {"writer": writer, "reader": reader}, core


def _keys(path):
    with safe_open(str(path / "weights.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_shared_tensors_are_stored_once_and_shared_after_loading(compiled, tmp_path):
    modules, core = compiled
    modules["writer"](X, torch.tensor([1]))  # the cache now holds something
    kiln.save_modules(tmp_path / "g", modules, files={"note.txt": "hi"})
    assert _keys(tmp_path / "g") == {"core.lin.weight", "core.lin.bias", "core.cache"}
    assert (tmp_path / "g" / "note.txt").read_text() == "hi"
    loaded = kiln.load_modules(tmp_path / "g")
    w, r = loaded["writer"], loaded["reader"]
    for name in ("core.lin.weight", "core.cache"):
        assert w.state[name] is r.state[name]
    torch.testing.assert_close(w.state["core.cache"], core.cache, rtol=0, atol=0)
    # a write through one loaded module is seen by the other, as in the originals
    y = torch.randn(1, 8)
    w(y, torch.tensor([2]))
    modules["writer"](y, torch.tensor([2]))
    torch.testing.assert_close(r(X), modules["reader"](X), rtol=0, atol=0)


def test_updated_buffers_saved_empty_load_as_zeros(compiled, tmp_path):
    modules, _ = compiled
    modules["writer"](X, torch.tensor([3]))
    kiln.save_modules(tmp_path / "g", modules, empty_state=True)
    assert _keys(tmp_path / "g") == {"core.lin.weight", "core.lin.bias"}
    manifest = json.loads((tmp_path / "g" / "reader" / "manifest.json").read_text())
    assert manifest["weights"]["tensors"]["core.cache"]["empty"] is True
    loaded = kiln.load_modules(tmp_path / "g")
    cache = loaded["writer"].state["core.cache"]
    assert cache is loaded["reader"].state["core.cache"] and not cache.any()
    # each member is still an artifact of its own
    alone = kiln.load(tmp_path / "g" / "reader")
    torch.testing.assert_close(alone(X), loaded["reader"](X), rtol=0, atol=0)


def test_same_name_different_tensors_get_their_own_keys(tmp_path):
    w = torch.randn(3, 4)
    a = {"w": w, "c": torch.ones(2), "t": w.t(), "k": torch.zeros(5)}
    b = {"w": w, "c": torch.full((2,), 2.0), "t": w.t(), "k": a["k"],
         "same": torch.ones(2)}
    b["c2"] = torch.ones(2)  # equal to a's c, but not named c: stored apart
    entries = save_shared_weights({"a": a, "b": b}, {"a": {"k"}}, tmp_path)
    assert _keys(tmp_path) == {"w", "c", "t", "b/c", "same", "c2"}
    assert entries["b"]["c"]["key"] == "b/c" and "key" not in entries["b"]["w"]
    assert entries["b"]["k"]["empty"] and entries["a"]["t"]["dim_order"] == [1, 0]
    shared = {}
    got = {m: load_weights(tmp_path, {"file": "weights.safetensors", "tensors": e}, "cpu",
                           shared) for m, e in entries.items()}
    assert got["a"]["w"] is got["b"]["w"] and got["a"]["k"] is got["b"]["k"]
    assert torch.equal(got["b"]["c"], b["c"]) and torch.equal(got["a"]["c"], a["c"])
    assert got["a"]["t"].stride() == w.t().stride() and torch.equal(got["a"]["t"], w.t())
    assert not got["a"]["k"].any()


def test_equal_constants_of_one_name_are_stored_once(tmp_path):
    entries = save_shared_weights({"a": {"c": torch.arange(4.0)},
                                   "b": {"c": torch.arange(4.0)}}, {}, tmp_path)
    assert _keys(tmp_path) == {"c"} and "key" not in entries["b"]["c"]


@pytest.fixture
def saved(compiled, tmp_path):
    kiln.save_modules(tmp_path / "g", compiled[0], empty_state=True)
    return tmp_path / "g"


def test_a_group_is_not_one_artifact(saved):
    with pytest.raises(ArtifactError, match="several compiled modules") as e:
        kiln.load(saved)
    assert "load_modules" in e.value.hint


def test_missing_module(saved):
    import shutil

    shutil.rmtree(saved / "reader")
    with pytest.raises(ArtifactError, match="lacks module 'reader'"):
        kiln.load_modules(saved)


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read .*modules.json"),
    ('{"format": "other"}', "not a kiln-modules manifest"),
    ('{"format": "kiln-modules", "format_version": 7, "modules": []}',
     "format version 7; this kiln reads version 1"),
])
def test_bad_group_manifest(saved, text, message):
    (saved / "modules.json").write_text(text)
    with pytest.raises(ArtifactError, match=message):
        kiln.load_modules(saved)


def test_corrupt_member_manifest_fails_before_any_weight(saved, monkeypatch):
    import kiln.artifact.weights as weights_mod

    monkeypatch.setattr(weights_mod, "_read", lambda *a: pytest.fail("read weights"))
    (saved / "writer" / "manifest.json").write_text("{")
    with pytest.raises(ArtifactError, match=r"writer/manifest\.json"):
        kiln.load_modules(saved)


def test_not_a_group(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        kiln.load_modules(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="has no modules.json"):
        kiln.load_modules(tmp_path)


def test_bad_names_and_a_foreign_directory(compiled, tmp_path):
    modules = compiled[0]
    for bad in ({"weights.safetensors": modules["reader"]}, {"a/b": modules["reader"]}, {}):
        with pytest.raises(ArgumentError):
            kiln.save_modules(tmp_path / "g", bad)
    with pytest.raises(ArgumentError, match="'modules.json' cannot name"):
        kiln.save_modules(tmp_path / "g", modules, files={"modules.json": "x"})
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "photo.jpg").write_bytes(b"\xff")
    with pytest.raises(ArtifactError, match="not a kiln artifact"):
        kiln.save_modules(tmp_path / "mine", modules)
    assert (tmp_path / "mine" / "photo.jpg").exists()
