"""The compile cache (kiln/artifact/compile_cache.py): a second compile of the same model
reuses the first's plan and kernels, bound to the model's current weights; anything
that changes the captured program, or the compile's other inputs, is a miss."""

import sys

import pytest
import torch

import kiln
from kiln.artifact import compile_cache
from kiln.errors import ArgumentError

pytestmark = pytest.mark.compile_cache

SCALE = 2.0


def scale() -> float:  # a module-level helper the model reads at trace time
    return SCALE


class Mlp(torch.nn.Module):
    def __init__(self, d=16, h=32, act="silu"):
        super().__init__()
        self.up, self.down, self.act = torch.nn.Linear(d, h), torch.nn.Linear(h, d), act

    def forward(self, x):
        h = self.up(x)
        h = torch.nn.functional.silu(h) if self.act == "silu" else torch.relu(h)
        return self.down(h) * scale()


def _compile(model, x, **kw):
    T = kiln.Dim("tokens", min=1, max=64)
    return kiln.compile(model, (x,), dynamic_shapes=({0: T},), **kw)


def _hit(exe) -> bool:
    """Whether `exe` came from the cache: decomposition and passes never ran."""
    t = exe.compile_timings
    assert "import/export/capture" in t  # every compile captures the program
    return "import/export/decompose" not in t and "compile_cache" in t


def _check(exe, model, *args):
    want = model(*args)
    got = exe(*args)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def test_second_compile_hits_and_reads_the_new_weights():
    x = torch.randn(6, 16)
    first = Mlp()
    a = _compile(first, x)
    assert not _hit(a)
    second = Mlp()  # same code and shapes, other weights
    b = _compile(second, x)
    assert _hit(b)
    _check(b, second, x)
    _check(b, second, torch.randn(11, 16))  # another size of the dynamic dim
    assert b.state["up.weight"] is second.up.weight or \
        torch.equal(b.state["up.weight"], second.up.weight)
    assert b.explain().splitlines()[0] == a.explain().splitlines()[0]


class ScalarConstant(torch.nn.Module):
    """Gemma's way: a 0-dim tensor made in forward scales the embeddings (a lifted
    constant the cache key hashes by value)."""

    def __init__(self, factor=8.0):
        super().__init__()
        self.lin, self.factor = torch.nn.Linear(16, 16), factor

    def forward(self, x):
        return self.lin(x) * torch.tensor(self.factor ** 0.5, dtype=x.dtype)


def test_a_zero_dim_constant_is_keyed_by_its_value():
    x = torch.randn(6, 16)
    a = _compile(ScalarConstant(), x)  # hashing it once raised "cannot view Float as Byte"
    assert not _hit(a)
    model = ScalarConstant()
    assert _hit(_compile(model, x))
    other = ScalarConstant(factor=3.0)
    exe = _compile(other, x)
    assert not _hit(exe)  # another constant: another program
    _check(exe, other, x)


class Cached(torch.nn.Module):
    """A KV cache's way: a non-persistent buffer the program writes (its values are state,
    never hashed: an 8B LLM's is 1 GB), beside a read-only one (a table: hashed)."""

    def __init__(self, table=1.0):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.register_buffer("cache", torch.zeros(8, 16), persistent=False)
        self.register_buffer("table", torch.full((16,), table), persistent=False)

    def forward(self, x, pos):
        self.cache[pos] = self.lin(x)
        return self.cache.sum(0) * self.table


def test_a_written_buffer_is_keyed_by_its_shape_a_read_one_by_its_values():
    x, pos = torch.randn(1, 16), torch.tensor([3])
    a = kiln.compile(Cached(), (x, pos))
    assert not _hit(a)
    model = Cached()
    model.cache.normal_()  # a cache already holding other rows
    exe = kiln.compile(model, (x, pos))
    assert _hit(exe)
    want = model.cache.clone()
    want[3] = model.lin(x)[0]
    got = exe(x, pos)
    assert torch.allclose(got, want.sum(0), atol=1e-5)
    assert torch.equal(model.cache, want)  # the model's own cache, written in place
    assert not _hit(kiln.compile(Cached(table=2.0), (x, pos)))


class MaskBuffer(torch.nn.Module):
    """A causal mask kept as a persistent buffer, rows picked by position (gpt-fast's
    way): kiln rewrites its gather as `key <= position` after reading its values, so a
    model whose buffer holds other values must not get that plan from the cache."""

    def __init__(self, causal=True):
        super().__init__()
        ones = torch.ones(16, 16, dtype=torch.bool)
        self.register_buffer("mask", ones.tril() if causal else ones)
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x, pos):
        q = self.q(x)[None, None]
        mask = self.mask[None, None, pos][..., :x.shape[0]]
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_plan_decided_by_a_buffers_values_is_kept_with_them():
    x, pos = torch.randn(6, 8), torch.arange(6)
    causal = MaskBuffer()
    assert not _hit(kiln.compile(causal, (x, pos)))
    again = MaskBuffer()
    again.q.load_state_dict(causal.q.state_dict())
    assert _hit(kiln.compile(again, (x, pos)))  # the same mask: the same plan
    full = MaskBuffer(causal=False)
    full.q.load_state_dict(causal.q.state_dict())
    exe = kiln.compile(full, (x, pos))
    assert not _hit(exe)  # served the causal plan, it was 0.76 off
    _check(exe, full, x, pos)


def test_changed_code_config_or_helper_misses(monkeypatch):
    x = torch.randn(6, 16)
    assert not _hit(_compile(Mlp(), x))
    relu = Mlp(act="relu")  # another branch of the model's code
    exe = _compile(relu, x)
    assert not _hit(exe)
    _check(exe, relu, x)
    wider = Mlp(h=48)  # a config size
    exe = _compile(wider, x)
    assert not _hit(exe)
    _check(exe, wider, x)
    monkeypatch.setattr(sys.modules[__name__], "SCALE", 3.0)  # a patched module global
    model = Mlp()
    exe = _compile(model, x)
    assert not _hit(exe)
    _check(exe, model, x)
    assert _hit(_compile(Mlp(), x))  # and that program is kept in turn


def test_other_examples_dtype_or_options_miss():
    x = torch.randn(6, 16)
    assert not _hit(_compile(Mlp(), x))
    assert not _hit(_compile(Mlp(), torch.randn(9, 16)))  # example sizes pick tunings
    assert not _hit(_compile(Mlp().double(), x.double()))
    assert not _hit(_compile(Mlp(), x, options={"tune": "none"}))
    assert _hit(_compile(Mlp(), x, options={"tune": "none"}))


class Folded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return x @ (self.w.t() * 2)  # weight-only compute: folded from the weight's values


def test_a_plan_folded_from_weight_values_is_never_kept():
    x = torch.randn(6, 16)
    a, b = Folded(), Folded()
    exe = _compile(a, x)
    assert any(k.startswith("kiln_folded.") for k in exe.state)
    exe = _compile(b, x)
    assert not _hit(exe)
    _check(exe, b, x)


def test_turned_off_or_unreadable(monkeypatch, tmp_path):
    x = torch.randn(6, 16)
    assert not _hit(_compile(Mlp(), x, options={"compile_cache": False}))
    assert not _hit(_compile(Mlp(), x))  # nothing was kept by the first
    monkeypatch.setenv("KILN_COMPILE_CACHE", "0")
    assert not _hit(_compile(Mlp(), x))
    monkeypatch.delenv("KILN_COMPILE_CACHE")
    for entry in (compile_cache._root()).iterdir():
        (entry / "manifest.json").write_text("{ not json")
    model = Mlp()
    exe = _compile(model, x)
    assert not _hit(exe)
    _check(exe, model, x)
    assert _hit(_compile(Mlp(), x))  # the garbage entry was replaced
    with pytest.raises(ArgumentError, match="compile_cache"):
        _compile(Mlp(), x, options={"compile_cache": "yes"})


def test_an_llm_compiled_again_generates_the_same_tokens():
    import kiln.models

    first = kiln.models.load("tiny", max_batch_size=2, seed=3)
    again = kiln.models.load("tiny", max_batch_size=2, seed=3)
    assert not _hit(first.prefill_module) and not _hit(first.decode_module)
    for module in (again.prefill_module, again.decode_module):  # kiln's own modules: found
        t = module.compile_timings                  # by their module tree, before export
        assert "compile_cache" in t and not any(k.startswith("import/") for k in t)
    prompt = [5, 17, 42, 9]
    want = first.generate(prompt, max_new_tokens=6, ignore_eos=True).ids
    assert again.generate(prompt, max_new_tokens=6, ignore_eos=True).ids == want


SCRIPT = """
import torch, kiln

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, WIDTH)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum(-1)

torch.manual_seed(0)
net, x = Net(), torch.randn(5, 8)
exe = kiln.compile(net, (x,), dynamic_shapes=({0: kiln.Dim("n", min=1, max=32)},))
err = (exe(x) - net(x)).abs().max().item()
print("decompose" not in str(sorted(exe.compile_timings)), err < 1e-5)
"""


def test_another_process_hits_and_an_edited_file_misses(tmp_path):
    """The fingerprint is the same in every process for the same code, and an edit to the
    model's file is a new key."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), KILN_PROGRESS="0")  # the test's cache dir

    def run(width: int) -> str:
        (tmp_path / "net.py").write_text(SCRIPT.replace("WIDTH", str(width)))
        done = subprocess.run([sys.executable, str(tmp_path / "net.py")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-2:]

    assert run(16) == ["False", "True"]  # compiled
    assert run(16) == ["True", "True"]  # kept by the first process
    assert run(24) == ["False", "True"]  # the file changed: compiled again
