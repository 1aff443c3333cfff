"""A dynamic dim bounded past the GEMV form's rows gets a narrow version: kiln.compile
runs dispatch and codegen again with the dim narrowed to the sizes whose products stay
GEMVs (kiln/dispatch/narrow_rows.py), and the module runs it at those sizes
(runtime/program.py). On the interpret target (generated kernels): which dims get one,
both versions against eager, saved and loaded, from the compile cache, bad manifests."""

import json
import shutil

import pytest
import torch

import kiln
from kiln.errors import ArtifactError
from tests.helpers import rel_err


class Block(torch.nn.Module):
    """A decode layer's products: a norm feeding two sibling projections, then one more."""

    def __init__(self, d=64):
        super().__init__()
        self.norm = torch.nn.RMSNorm(d)
        self.q = torch.nn.Linear(d, d, bias=False)
        self.k = torch.nn.Linear(d, d // 2, bias=False)
        self.o = torch.nn.Linear(d + d // 2, d, bias=False)

    def forward(self, x):
        h = self.norm(x)
        return self.o(torch.cat([self.q(h), self.k(h)], -1)) + x


class Head(torch.nn.Module):
    """Three products over the rows, one (an LM head) over picked rows: `at` alone sets
    the head's rows."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(d, d) for _ in range(3))
        self.head = torch.nn.Linear(d, 48)

    def forward(self, x, at):
        h = self.c(self.b(self.a(x)))
        return self.head(h[at])


def _compile(model, rows, dtype=torch.float16, lo=1, hi=4, **kw):
    x = torch.randn(rows, 64, dtype=dtype)
    batch = kiln.Dim("batch", min=lo, max=hi)
    return kiln.compile(model, (x,), dynamic_shapes=({0: batch},), **{"target": "interpret",
                                                                       **kw})


def _names(program):
    return [getattr(getattr(k, "spec", None), "name", "") for k in
            program.kplan.kernels.values()]


@pytest.fixture(scope="module")
def half():
    torch.manual_seed(0)
    model = Block().half()
    return model, _compile(model, 2)


def test_one_row_runs_gemvs_and_every_size_matches_eager(half):
    model, exe = half
    narrow = exe.program.narrow
    assert narrow is not None and narrow.hi == 1
    assert exe.plan.dim_names[narrow.symbol] == "batch"
    assert narrow.program.plan.symbols[narrow.symbol].hi == 1
    assert all("gemv" in n for n in _names(narrow.program) if "matmul" in n or "gemv" in n)
    assert not any("gemv" in n for n in _names(exe.program))
    # the norm folds into the GEMVs there: fewer kernels
    assert len(narrow.program.plan.regions) < len(exe.plan.regions)
    ref_model = Block()
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    for rows in (1, 3, 4):
        x = torch.randn(rows, 64, dtype=torch.float16)
        env = exe.program.bind([x])
        assert (exe.program.for_sizes(env) is narrow.program) == (rows == 1)
        assert rel_err(exe(x).float(), ref_model(x.float())) <= 1e-2, rows
    assert "narrow version: calls with batch" in exe.explain()
    listed = exe.explain(kernels=True)  # its kernels too
    assert "== the narrow version" in listed and "kiln_gemv" in listed
    assert "== the narrow version" not in exe.explain()


def test_fp32_keeps_gemvs_up_to_eight_rows():
    torch.manual_seed(1)
    model = Block()
    exe = _compile(model, 2, torch.float32, hi=16, options={"compile_cache": False})
    assert exe.program.narrow.hi == 8
    # its passes timed under "narrow", apart from the plan's own
    assert {"narrow", "narrow/dispatch/form_regions", "dispatch/form_regions",
            "narrow/codegen/select_kernels"} <= set(exe.compile_timings)
    for rows in (8, 9):
        x = torch.randn(rows, 64)
        env = exe.program.bind([x])
        assert (exe.program.for_sizes(env) is exe.program.narrow.program) == (rows == 8)
        assert rel_err(exe(x), model(x)) <= 1e-5, rows


@pytest.mark.parametrize("case", ["within", "static", "from_two", "cpu", "off"])
def test_no_narrow_version_where_it_would_change_nothing(case):
    model = Block().half()
    kw = {"from_two": {"lo": 2}, "cpu": {"target": "cpu"},
          "off": {"options": {"narrow_version": False}}}.get(case, {})
    if case == "within":  # fp32 up to 8 rows: every size is already a GEMV's
        exe = _compile(Block(), 2, torch.float32, hi=8)
    elif case == "static":
        exe = kiln.compile(model, (torch.randn(3, 64, dtype=torch.float16),),
                           target="interpret")
    elif case == "cpu":
        exe = _compile(Block(), 2, torch.float32, hi=16, **kw)
    else:
        exe = _compile(model, 2, **kw)
    assert exe.program.narrow is None


def test_a_dim_that_sets_only_the_heads_rows_is_not_worth_a_second_plan():
    model = Head().half()
    x = torch.randn(6, 32, dtype=torch.float16)
    at = torch.tensor([5, 2])
    rows, picks = kiln.Dim("rows", min=2, max=16), kiln.Dim("picks", min=1, max=4)
    exe = kiln.compile(model, (x, at), dynamic_shapes=({0: rows}, {0: picks}),
                       target="interpret")
    assert exe.program.narrow is None
    # with the rows from one, they do: most products are theirs
    rows = kiln.Dim("rows", min=1, max=16)
    exe = kiln.compile(model, (x, at), dynamic_shapes=({0: rows}, {0: picks}),
                       target="interpret")
    assert exe.plan.dim_names[exe.program.narrow.symbol] == "rows"


def test_saved_and_loaded_with_its_narrow_version(half, tmp_path):
    _, exe = half
    exe.save(tmp_path / "m.kiln")
    manifest = json.loads((tmp_path / "m.kiln" / "manifest.json").read_text())
    assert manifest["narrow"]["max"] == 1
    loaded = kiln.load(tmp_path / "m.kiln")
    assert loaded.program.narrow.hi == 1
    kernels = (sorted(_names(m.program.narrow.program)) for m in (loaded, exe))
    assert next(kernels) == next(kernels)
    for rows in (1, 3):
        x = torch.randn(rows, 64, dtype=torch.float16)
        assert torch.equal(loaded(x), exe(x)), rows


@pytest.mark.parametrize("field,value,says", [
    ("symbol", "s_none", "is not one of the plan's dims"),
    ("max", 9, "not a size within its bounds"),
    ("max", "1", "not a size within its bounds"),
    ("kernels", {}, "have no kernel"),
])
def test_a_bad_narrow_entry_is_an_artifact_error(half, tmp_path, field, value, says):
    _, exe = half
    exe.save(tmp_path / "good.kiln")
    bad = tmp_path / "bad.kiln"
    shutil.copytree(tmp_path / "good.kiln", bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["narrow"][field] = value
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=says) as e:
        kiln.load(bad)
    assert "recompile" in e.value.hint


@pytest.mark.compile_cache
def test_a_compile_cache_hit_keeps_the_narrow_version():
    torch.manual_seed(2)
    model = Block().half()
    first = _compile(model, 2)
    again = _compile(model, 2)
    assert "import/export/decompose" not in again.compile_timings  # a hit
    assert again.program.narrow is not None and again.program.narrow.hi == 1
    x = torch.randn(1, 64, dtype=torch.float16)
    assert torch.equal(again(x), first(x))


def test_a_narrow_version_that_fails_to_compile_leaves_the_plan_for_every_size(monkeypatch):
    """It only speeds some sizes up: a failure there is a warning, not a failed compile."""
    import kiln.api as api
    from kiln.errors import KilnError, KilnWarning
    from kiln.pipeline import Pass

    real, calls = api.select_kernels, []

    def planted(plan, ctx):
        calls.append(plan)
        if len(calls) == 2:  # the narrow version's
            raise KilnError("a planted codegen failure")
        return real(plan, ctx)

    monkeypatch.setattr(api, "select_kernels", Pass(real.name, planted, real.establishes))
    model = Block().half()
    with pytest.warns(KilnWarning, match="batch <= 1 .* planted codegen failure"):
        exe = _compile(model, 2, options={"compile_cache": False})
    assert exe.program.narrow is None and len(calls) == 2
    x = torch.randn(1, 64, dtype=torch.float16)
    assert rel_err(exe(x).float(), model.float()(x.float())) <= 1e-2


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_transformers_models_with_a_batch_dim_decode_one_row_by_gemvs(family):
    """Models written without kiln in mind (RMSNorm and LayerNorm families): one token
    each for up to 4 rows, fp16; the one-row plan has fewer kernels (norms folded,
    siblings grouped) and both sizes match fp32 eager."""
    tf = pytest.importorskip("transformers")
    cfg = (tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
           if family == "llama" else
           tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64))
    torch.manual_seed(0)
    ref = tf.AutoModelForCausalLM.from_config(cfg).eval()
    half = tf.AutoModelForCausalLM.from_config(cfg).eval()
    half.load_state_dict(ref.state_dict())
    half = half.half()
    batch = kiln.Dim("batch", min=1, max=4)
    exe = kiln.compile(half, (), {"input_ids": torch.randint(3, 128, (2, 1)),
                                  "use_cache": False},
                       dynamic_shapes={"input_ids": {0: batch}, "use_cache": None},
                       target="interpret")
    narrow = exe.program.narrow
    assert narrow is not None and narrow.hi == 1
    assert len(narrow.program.plan.regions) < len(exe.plan.regions)
    for rows in (1, 3):
        ids = torch.randint(3, 128, (rows, 1))
        with torch.no_grad():
            want = ref(input_ids=ids, use_cache=False).logits
        got = exe(input_ids=ids, use_cache=False).logits
        assert rel_err(got.float(), want) <= 1e-2, rows
