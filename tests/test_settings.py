"""kiln.settings: every KILN_* variable in one place, and KILN_LOG for library users."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import settings

REPO = Path(__file__).resolve().parent.parent


def test_every_kiln_variable_read_in_kiln_is_declared():
    """No module reads a KILN_* variable behind settings' back (os.environ / getenv)."""
    offenders = []
    for path in (REPO / "kiln").rglob("*.py"):
        if path.name == "settings.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if "KILN_" in line and ("environ.get" in line or "getenv" in line):
                offenders.append(f"{path.relative_to(REPO)}:{i}")
    assert not offenders
    assert set(settings.SETTINGS) == {"KILN_LOG", "KILN_DUMP_IR", "KILN_CACHE_DIR",
                                      "KILN_PROGRESS", "KILN_TUNE", "KILN_TUNE_TIMING",
                                      "KILN_TUNE_OVERLAP", "KILN_DIST_TIMEOUT",
                                      "KILN_COMPILE_CACHE", "KILN_DECOMPOSE",
                                      "KILN_PDL", "KILN_FP8_GEMV_PACKED", "KILN_FP8_GEMM_TMA"}


def test_values_are_read_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_LOG", "frontend, dispatch")
    assert settings.log_stages() == ["kiln.frontend", "kiln.dispatch"]
    monkeypatch.setenv("KILN_LOG", "all")
    assert settings.log_stages() == ["kiln"]
    monkeypatch.delenv("KILN_LOG")
    assert settings.log_stages() == []
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "c"))
    assert settings.cache_dir() == tmp_path / "c" and (tmp_path / "c").is_dir()
    monkeypatch.setenv("KILN_PROGRESS", "0")
    assert not settings.progress_enabled()
    monkeypatch.setenv("KILN_PROGRESS", "1")
    assert settings.progress_enabled()
    monkeypatch.delenv("KILN_TUNE", raising=False)
    assert settings.tune_mode() is None
    monkeypatch.setenv("KILN_DUMP_IR", str(tmp_path))
    assert settings.dump_ir_dir() == tmp_path


LIBRARY_USE = """
import torch, kiln
kiln.compile(torch.nn.ReLU(), (torch.randn(3),))
"""


def _run_library(kiln_log: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILN_LOG": kiln_log}
    r = subprocess.run([sys.executable, "-c", LIBRARY_USE], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stderr


def test_kiln_log_works_for_library_users():
    """Set before `import kiln`: configured at import (and not twice at compile)."""
    err = _run_library("frontend")
    assert "kiln.frontend: imported" in err and "kiln.pipeline" not in err
    assert err.count("kiln.frontend: imported") == 1  # one handler, not one per call


@pytest.fixture
def kiln_loggers():
    """Take back the handlers and levels the test's KILN_LOG gave kiln's loggers."""
    yield
    for name in ("kiln", "kiln.frontend"):
        lg = logging.getLogger(name)
        lg.handlers = [h for h in lg.handlers if not getattr(h, "_kiln_log", False)]
        lg.setLevel(logging.NOTSET)


def test_kiln_log_set_after_import_applies_at_compile(monkeypatch, capsys, kiln_loggers):
    import torch

    import kiln

    monkeypatch.delenv("KILN_LOG", raising=False)
    kiln.compile(torch.nn.ReLU(), (torch.randn(3),))
    assert "kiln.frontend" not in capsys.readouterr().err
    monkeypatch.setenv("KILN_LOG", "frontend")
    kiln.compile(torch.nn.ReLU(), (torch.randn(3),))
    assert "kiln.frontend: imported" in capsys.readouterr().err
