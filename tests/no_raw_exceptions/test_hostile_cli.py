"""The `kiln` command (kiln.cli.main, in-process) on fuzz repros and on bad arguments.

A command either succeeds (status 0), or ends with `kiln: error: ...` and status 2, or
is an argparse usage error (SystemExit 2 with its `error:` line); never a traceback,
never `kiln: internal error` (contract.py's rule, in the command line's words).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kiln.cli import main

REPROS = Path(__file__).parents[1] / "fuzz" / "repros"
# one cpu and one interpret repro, wrapped as `file.py:factory` models
FACTORIES = '''
import importlib.util
from pathlib import Path

import torch
import kiln


def _repro(name):
    spec = importlib.util.spec_from_file_location(name, Path({repros!r}) / (name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fuzz_cpu():
    r = _repro("repro_seed241_crash")
    return r.Fuzzed().eval(), r.make_args(None, 0)


def fuzz_interpret():
    r = _repro("repro_seed100036_crash")
    D = kiln.Dim("D", min=r.DYN[0], max=r.DYN[1])
    dyn = tuple({{i: D for i, s in enumerate(shape) if s == "D"}} or None
                for shape, _, _ in r.INPUTS)
    return r.Fuzzed().eval(), r.make_args(r.DYN[2], 0), dyn


def bad_dynamic_shapes():
    return torch.nn.Linear(3, 3), (torch.randn(2, 3),), 5


def raises_in_forward():
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("the user's forward broke")
    return Broken(), (torch.randn(2),)


def args_none():
    return torch.nn.Linear(3, 3), None


def kwargs_not_a_dict():
    return {{"model": torch.nn.Linear(3, 3), "args": (torch.randn(2, 3),), "kwargs": 5}}


def returns_an_int():
    return 5


def not_a_module():
    return (lambda x: x), (torch.randn(2),)
'''


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "models.py").write_text(FACTORIES.format(repros=str(REPROS)))
    (d / "broken_import.py").write_text("import no_such_module_anywhere\n")
    (d / "syntax.py").write_text("def make(:\n")
    (d / "file.txt").write_text("x")
    (d / "empty.kiln").mkdir()
    assert _ok(["compile", f"{d}/models.py:fuzz_cpu", "-o", f"{d}/cpu.kiln"])
    assert _ok(["compile", f"{d}/models.py:fuzz_interpret", "--target", "interpret",
                "-o", f"{d}/interp.kiln"])
    shutil.copytree(d / "cpu.kiln", d / "bad.kiln")
    (d / "bad.kiln" / "manifest.json").write_text("{")
    return d


def _ok(argv) -> bool:
    return main([str(a) for a in argv]) == 0


def _run(argv, capsys) -> tuple[int, str]:
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse: usage errors (2), --help / --version (0)
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    assert "Traceback" not in out, out
    return rc, err


GOOD = [
    ["run", "{d}/cpu.kiln"], ["run", "{d}/interp.kiln", "--size", "D=5"],
    ["explain", "{d}/cpu.kiln", "--kernels"], ["explain", "{d}/interp.kiln", "--kernels"],
    ["run", "{d}/models.py:fuzz_cpu"], ["run", "{d}/models.py:fuzz_interpret",
                                        "--target", "interpret"],
    ["explain", "{d}/models.py:fuzz_cpu"], ["compile", "{d}/models.py:fuzz_cpu",
                                            "--compile-to", "dispatch"],
    ["--version"], ["compile", "--help"],
]


@pytest.mark.parametrize("argv", GOOD, ids=[" ".join(a) for a in GOOD])
def test_commands_that_work(workdir, capsys, argv):
    rc, err = _run([a.format(d=workdir) for a in argv], capsys)
    assert rc == 0, err


BAD = [
    [], ["bogus"], ["compile"], ["compile", "--bogus"], ["run", "{d}/cpu.kiln", "--size", "D"],
    ["run", "{d}/cpu.kiln", "--repeat", "x"], ["compile", "{d}/models.py:fuzz_cpu",
                                               "--tune", "x"],
    ["compile", "nope.py:make"], ["compile", "{d}/models.py"], ["compile", "{d}/models.py:"],
    ["compile", "{d}/models.py:nope"], ["compile", "{d}/models.py:bad_dynamic_shapes"],
    ["compile", "{d}/models.py:raises_in_forward"], ["compile", "{d}/models.py:args_none"],
    ["compile", "{d}/models.py:kwargs_not_a_dict"], ["compile", "{d}/models.py:returns_an_int"],
    ["compile", "{d}/models.py:not_a_module"], ["compile", "{d}/broken_import.py:make"],
    ["compile", "{d}/syntax.py:make"], ["compile", "tiny-lama"],
    ["compile", "{d}/models.py:fuzz_cpu", "--target", "tpu"],
    ["compile", "{d}/models.py:fuzz_cpu", "-o", "{d}/file.txt"],
    ["compile", "{d}/models.py:fuzz_cpu", "-o", "{d}/file.txt/sub.kiln"],
    ["compile", "{d}/models.py:fuzz_cpu", "--dump-ir", "{d}/file.txt"],
    ["compile", "{d}/cpu.kiln"],
    ["run", "{d}/interp.kiln", "--size", "D=100"], ["run", "{d}/interp.kiln", "--size", "E=3"],
    ["run", "{d}/cpu.kiln", "--target", "interpret"], ["run", "{d}/cpu.kiln", "--target", "x"],
    ["run", "{d}/bad.kiln"], ["run", "{d}/empty.kiln"], ["run", "{d}/missing.kiln"],
    ["run", "{d}/file.txt"], ["run", "{d}/models.py:raises_in_forward"],
    ["run", "{d}/models.py:fuzz_interpret", "--size", "D=1"],
    ["run", "tiny-llama", "--prompt-len", "0"], ["run", "tiny-llama", "--prompt-len", "-1"],
    ["run", "tiny-llama", "--steps", "0"], ["run", "tiny-llama", "--prompt-len", "100000"],
    ["explain", "{d}/bad.kiln"], ["explain", "{d}/cpu.kiln", "--target", "cuda:sm_90"],
    ["generate"], ["generate", "--model", "{d}/missing", "--prompt", "hi"],
    ["generate", "--model", "{d}", "--prompt", "hi"],
    ["generate", "--model", "{d}/file.txt", "--prompt", "hi"],
    ["generate", "--random-weights", "--config", "nope", "--prompt", "x"],
    ["generate", "--config", "tiny", "--prompt", "x"],
    ["generate", "--random-weights", "--config", "tiny"],
    ["generate", "--random-weights", "--config", "tiny", "--prompt-ids", "a,b"],
    *[["generate", "--random-weights", "--config", "tiny", "--prompt", "x", *flags]
      for flags in (["--max-new-tokens", "0"], ["--temperature", "-1"], ["--top-p", "5"],
                    ["--top-k", "0"], ["--max-seq-len", "0"], ["--max-seq-len", "-5"],
                    ["--max-seq-len", "100000"], ["--cache", "paged", "--block-size", "0"],
                    ["-tp", "0"], ["-pp", "-1"], ["--target", "tpu"], ["--dtype", "int8"])],
    *[["bench", "--device", "cpu", "--preset", "tiny", *flags]
      for flags in (["--prefill", "x"], ["--prefill", "0"], ["--prefill", "100000"],
                    ["--runners", "nope"], ["--runners", ""], ["--iters", "0"],
                    ["--layers", "0"], ["--check", "{d}/missing.json"],
                    ["--check", "{d}/file.txt"], ["--out", "{d}/file.txt"])],
    ["bench", "--device", "tpu"],
]


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a) or "(none)" for a in BAD])
def test_bad_commands_end_with_a_clean_error(workdir, capsys, argv):
    rc, err = _run([a.format(d=workdir) for a in argv], capsys)
    assert rc == 2, err
    assert "error: " in err
