"""The tuning cache and quarantine under fault: unreadable entries, a cache directory
that cannot be written, two processes compiling one model into one cache. Each still
compiles correctly, never crashes, never leaves an entry another compile misreads."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

from kiln.codegen.autotune.cache import ChoiceCache
from kiln.codegen.autotune.quarantine import CRASH, WRONG, WRONG_CHECK, FailureKey, Quarantine
from kiln.codegen.build.spec import Config
from kiln.target import get_target
from tests.codegen.test_autotune import W4, add_spec, tune

SPEC = add_spec(Config.make(4, 1, XBLOCK=256), [W4, Config.make(4, 1, XBLOCK=128)])


def _entries():
    root = ChoiceCache().root
    return [p for p in root.iterdir() if not p.name.startswith(".")] if root.exists() else []


def test_unreadable_choice_entries_are_misses_and_get_replaced():
    first, _ = tune(SPEC, tune="fast")
    (entry,) = _entries()
    for bad in ("", "{truncated", "[1, 2]", json.dumps({"kind": "triton", "config": None}),
                json.dumps({"kind": "triton", "config": {"params": 3}})):
        (entry / "choice.json").write_text(bad)
        assert ChoiceCache().get(entry.name) is None
        again, region = tune(SPEC, tune="fast")
        assert again.config == first.config and "(cached)" not in region.notes[-1]
    assert ChoiceCache().get(entry.name).config == first.config  # rewritten whole


def test_unreadable_quarantine_records_block_nothing():
    q = Quarantine()
    key = FailureKey.of(SPEC, W4, get_target("cuda:sm_90"))
    q.record(key, CRASH, "planted", "add", "test")
    assert q.blocked(key) is not None
    for bad in ("", "{", "[]", json.dumps({"key": {"nope": 1}})):
        q._path(key).write_text(bad)
        assert q.get(key) is None and q.blocked(key) is None and q.all() == []
    choice, _ = tune(SPEC, tune="fast")
    assert choice.kind == "triton"


def test_a_wrong_verdict_of_an_older_output_check_is_retried():
    """`wrong` records written before the in-place check (WRONG_CHECK 2) had judged
    correct KV-cache write kernels wrong: such a record blocks nothing; a new one does."""
    q = Quarantine()
    key = FailureKey.of(SPEC, W4, get_target("cuda:sm_90"))
    q.record(key, WRONG, "planted", "add", "test")
    assert q.blocked(key) is not None and q.get(key).check == WRONG_CHECK
    old = json.loads(q._path(key).read_text())
    del old["check"]  # as the first check wrote it
    q._path(key).write_text(json.dumps(old))
    assert q.get(key).kind == WRONG and q.blocked(key) is None


def test_a_cache_directory_that_cannot_be_written(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("KILN_CACHE_DIR", str(blocker / "cache"))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        first, _ = tune(SPEC, tune="fast")
        again, _ = tune(SPEC, tune="fast")  # nothing was kept: tuned again, same answer
    assert first.kind == again.kind == "triton" and first.config == again.config
    assert "cannot be used" in caplog.text and "KILN_CACHE_DIR" in caplog.text
    assert not (blocker / "cache").exists()


def test_a_cache_that_fails_mid_write(tmp_path, monkeypatch, caplog):
    """The directory exists but writes fail (full disk, revoked permission)."""
    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tempfile.mkdtemp", refuse)
    monkeypatch.setattr("pathlib.Path.write_text", refuse)
    with caplog.at_level(logging.WARNING, logger="kiln.codegen"):
        choice, _ = tune(SPEC, tune="fast")
        q = Quarantine()
        key = FailureKey.of(SPEC, W4, get_target("cuda:sm_90"))
        assert q.record(key, CRASH, "x", "add", "t").kind == CRASH  # kept for this compile
    assert choice.kind == "triton" and "cannot be written" in caplog.text


COMPILE = textwrap.dedent('''
    import torch, kiln
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2 + 1
    exe = kiln.compile(M(), (torch.randn(8, 16),), target="cuda:sm_90")
    print("regions", sorted(k.kind for k in exe.program.kplan.kernels.values()))
''')


def test_two_processes_compile_one_model_into_one_cache(tmp_path):
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "shared"), "PYTHONPATH": os.getcwd()}
    procs = [subprocess.Popen([sys.executable, "-c", COMPILE], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
        assert "regions ['triton']" in out
    root = tmp_path / "shared" / "autotune" / "choices"
    entries = [p for p in root.iterdir() if not p.name.startswith(".")]
    assert entries and all(ChoiceCache(root).get(p.name) is not None for p in entries)
    third = subprocess.run([sys.executable, "-c", COMPILE], env=env, text=True,
                           capture_output=True, timeout=240)
    assert third.returncode == 0 and "regions ['triton']" in third.stdout
