"""Save / load: a loaded module is the saved one, bit for bit, without recompiling."""

import copy
import json

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import kiln
from kiln.models.llama import example_inputs, tiny_llama


@pytest.fixture
def no_compiler(monkeypatch):
    """Loading must not export or run a single pass: make both impossible."""
    import kiln.frontend.export
    import kiln.frontend.import_pass
    import kiln.pipeline

    def forbidden(*a, **k):
        raise AssertionError("kiln.load exported or ran the pipeline")

    monkeypatch.setattr(kiln.frontend.export, "import_model", forbidden)
    monkeypatch.setattr(kiln.frontend.export, "capture", forbidden)
    monkeypatch.setattr(kiln.frontend.import_pass, "capture", forbidden)
    monkeypatch.setattr(kiln.frontend.import_pass, "import_exported", forbidden)
    monkeypatch.setattr(kiln.pipeline.PassManager, "run", forbidden)


def _assert_identical(a, b):
    la, sa = pytree.tree_flatten(a)
    lb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    return model, kiln.compile(model, args, dynamic_shapes=dynamic)


def _steps(vocab):
    gen = torch.Generator().manual_seed(1)
    pos = 0
    for n in (7, 1, 1, 3):  # a prefill, then decode steps
        yield torch.randint(0, vocab, (1, n), generator=gen), torch.arange(pos, pos + n)
        pos += n


def test_tiny_llama_prefill_then_decode_bit_identical(llama, tmp_path, no_compiler):
    model, exe = llama
    for b in model.buffers():
        b.zero_()
    exe.save(tmp_path / "llama.kiln")
    loaded = kiln.load(tmp_path / "llama.kiln")
    for tokens, pos in _steps(model.cfg.vocab_size):
        _assert_identical(loaded(tokens, pos), exe(tokens, pos))
    for name, t in loaded.state.items():  # the KV caches evolved identically
        assert torch.equal(t, exe.state[name]), name
    assert loaded.dim_names == {"seq": next(iter(exe.plan.symbols))} == exe.dim_names
    assert loaded.example_sizes == exe.example_sizes == {next(iter(exe.plan.symbols)): 8}


def test_kv_cache_contents_are_saved(llama, tmp_path, no_compiler):
    """A module saved mid-conversation resumes where it stopped."""
    model, exe = llama
    for b in model.buffers():
        b.zero_()
    exe(torch.randint(0, 256, (1, 5)), torch.arange(5))
    exe.save(tmp_path / "mid.kiln")
    loaded = kiln.load(tmp_path / "mid.kiln")
    assert any(t.abs().sum() > 0 for n, t in loaded.state.items() if "cache" in n)
    tok, pos = torch.tensor([[3]]), torch.tensor([5])
    _assert_identical(loaded(tok, pos), exe(tok, pos))


def test_loaded_state_is_its_own(llama, tmp_path):
    """Running the loaded module does not touch the original model's buffers."""
    model, exe = llama
    exe.save(tmp_path / "own.kiln")
    loaded = kiln.load(tmp_path / "own.kiln")
    before = [b.clone() for b in model.buffers()]
    loaded(torch.randint(0, 256, (1, 4)), torch.arange(4))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


class KwModel(nn.Module):
    """Keyword args, a dict output, tied + non-contiguous + mutable state, -inf, FloorDiv."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.lin.weight  # tied
        self.register_buffer("wt", torch.randn(8, 8).t())  # not contiguous
        self.register_buffer("steps", torch.zeros(8))  # updated every call

    def forward(self, x, *, bias):
        self.steps.add_(1)
        h = self.lin(x) * 2.0 + bias
        h = h.masked_fill(h > 3, float("-inf")).clamp(min=-1e4)
        out = self.head(h) + h @ self.wt + self.steps
        half = out[: out.shape[0] // 2]
        return {"out": out, "stats": {"sum": out.sum(-1), "half_max": half.amax(-1)}}


@pytest.fixture(scope="module")
def kw():
    model = KwModel()
    x, b = torch.randn(6, 8), torch.randn(8)
    # Dim.AUTO: torch.export refuses a named Dim for `out.shape[0] // 2` in torch 2.13.
    exe = kiln.compile(copy.deepcopy(model), (x,), {"bias": b},
                       dynamic_shapes={"x": {0: torch.export.Dim.AUTO}, "bias": None})
    return model, exe


def test_kwargs_and_dict_output_bit_identical(kw, tmp_path, no_compiler):
    model, exe = kw
    exe.save(tmp_path / "kw.kiln")
    saved_steps = exe.state["steps"].clone()
    loaded = kiln.load(tmp_path / "kw.kiln")
    for n in (6, 5, 31):
        x, b = torch.randn(n, 8), torch.randn(8)
        _assert_identical(loaded(x, bias=b), exe(x, bias=b))
    assert torch.equal(loaded.state["steps"], saved_steps + 3)
    # Tied weights come back as one tensor; a transposed one with its strides.
    assert loaded.state["head.weight"] is loaded.state["lin.weight"]
    assert loaded.state["wt"].stride() == model.wt.stride() == (1, 8)
    assert torch.equal(loaded.state["wt"], model.wt)
    manifest = json.loads((tmp_path / "kw.kiln" / "manifest.json").read_text())
    assert manifest["weights"]["tensors"]["lin.weight"] == {
        "shape": [8, 8], "dtype": "float32", "same_as": "head.weight"}
    assert "FloorDiv" in json.dumps(manifest["plan"]["regions"])


def test_save_load_save_is_stable(kw, tmp_path):
    _, exe = kw
    exe.save(tmp_path / "a")
    kiln.load(tmp_path / "a").save(tmp_path / "b")
    assert (tmp_path / "a" / "manifest.json").read_text() == \
        (tmp_path / "b" / "manifest.json").read_text()
    assert (tmp_path / "a" / "weights.safetensors").read_bytes() == \
        (tmp_path / "b" / "weights.safetensors").read_bytes()


def test_save_replaces_an_artifact_but_not_other_data(kw, tmp_path):
    _, exe = kw
    exe.save(tmp_path / "m.kiln")
    exe.save(tmp_path / "m.kiln")  # overwriting an artifact is fine
    assert sorted(p.name for p in (tmp_path / "m.kiln").iterdir()) == [
        "manifest.json", "weights.safetensors"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("mine")
    with pytest.raises(kiln.errors.ArtifactError, match="not a kiln artifact"):
        exe.save(tmp_path / "data")
    assert (tmp_path / "data" / "keep.txt").read_text() == "mine"


def test_manifest_from_before_the_plan_held_dim_names(llama, tmp_path):
    """Older manifests kept the Dim names at the top level, name -> symbol: still read."""
    _, exe = llama
    sym = next(iter(exe.plan.symbols))
    exe.save(tmp_path / "old.kiln")
    path = tmp_path / "old.kiln" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["plan"].pop("dim_names") == {sym: "seq"}
    manifest["dim_names"] = {"seq": sym}
    path.write_text(json.dumps(manifest))
    assert kiln.load(tmp_path / "old.kiln").plan.dim_names == {sym: "seq"}
    del manifest["dim_names"]
    path.write_text(json.dumps(manifest))
    assert kiln.load(tmp_path / "old.kiln").plan.dim_names == {}


class Table(nn.Module):
    """A table read at positions given by the call, as Meta's Llama reads its complex64
    RoPE table (`freqs_cis[input_pos]`): the plan holds the table itself."""

    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", table, persistent=False)

    def forward(self, x, pos):
        row = self.table[pos]
        return x + (torch.view_as_real(row).sum(-1) if row.is_complex() else row.float())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.uint16, torch.uint32])
def test_every_dtype_safetensors_writes_loads_back(dtype, tmp_path, request):
    """The load checked the file's dtype codes against a table that lacked C64 and the
    unsigned ints: such a module saved, then failed to load ('is None[4]')."""
    table = torch.polar(torch.ones(4), torch.arange(4.0)) if dtype is torch.complex64 \
        else torch.arange(4).to(dtype)
    model = Table(table)
    x, pos = torch.randn(2), torch.tensor([1, 2])
    exe = kiln.compile(model, (x, pos))
    exe.save(tmp_path / "t.kiln")
    request.getfixturevalue("no_compiler")
    loaded = kiln.load(tmp_path / "t.kiln")
    assert loaded.state["table"].dtype == dtype
    pos = torch.tensor([3, 0])
    _assert_identical(loaded(x, pos), model(x, pos))


def test_a_dtype_safetensors_cannot_write_is_named_at_save(tmp_path):
    table = torch.polar(torch.ones(4, dtype=torch.float64), torch.arange(4.0).double())
    exe = kiln.compile(Table(table), (torch.randn(2), torch.tensor([1, 2])))
    with pytest.raises(kiln.errors.ArtifactError, match="'table' is complex128") as e:
        exe.save(tmp_path / "t.kiln")
    assert "complex64" in e.value.hint
    assert not (tmp_path / "t.kiln").exists()
