"""The `kiln` command, through kiln.cli.main (fast), plus the entry point's --help."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from kiln.cli import main

REPO = Path(__file__).resolve().parents[1]

MODEL_FILE = '''
import torch
import kiln


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, ids, *, scale):
        h = self.lin(self.emb(ids)) * scale
        return {"h": h, "norm": (h * h).sum(-1).sqrt()}


def make():
    T = kiln.Dim("T", min=2, max=40)
    return {"model": Net(), "args": (torch.randint(0, 50, (6,)),),
            "kwargs": {"scale": torch.randn(8)},
            "dynamic_shapes": {"ids": {0: T}, "scale": None}}


def not_a_model():
    return (42, (torch.randn(2),))


def wrong_shape():
    return "model"


def broken():
    return helper()


def helper():
    raise ValueError("the factory broke")


def bad_kwargs():
    return {"model": Net(), "args": (torch.randint(0, 50, (6,)),), "kwargs": 5}


class Weird(torch.nn.Module):
    def forward(self, x):
        return torch.special.erfinv(x)


def weird():
    return Weird(), (torch.rand(4) * 0.5,)


def rows():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    return {"model": mlp, "args": (torch.randn(3, 8),),
            "dynamic_shapes": ({0: kiln.Dim("rows", min=1, max=32)},)}
'''


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "net.py"
    path.write_text(MODEL_FILE)
    return path


@pytest.fixture(scope="module")
def artifact(model_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "net.kiln"
    assert main(["compile", f"{model_file}:make", "-o", str(out)]) == 0
    return out


def _run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _fails(capsys, *argv) -> str:
    rc, out, err = _run(capsys, *argv)
    assert rc == 2, (out, err)
    assert err.startswith("kiln: error: ") and "Traceback" not in err
    return err


def test_compile_writes_an_artifact(artifact):
    assert (artifact / "manifest.json").is_file()
    assert (artifact / "weights.safetensors").is_file()
    assert kiln.load(artifact).dim_names == {"T": next(iter(kiln.load(artifact).plan.symbols))}


def test_compile_names_a_narrow_version(model_file, tmp_path, capsys):
    """fp32 products of up to 8 rows run as GEMVs: those sizes get a plan of their own."""
    rc, out, _ = _run(capsys, "compile", f"{model_file}:rows", "--target", "interpret",
                      "-o", tmp_path / "rows.kiln")
    assert rc == 0 and "rows <= 8 runs a plan of its own" in out
    assert kiln.load(tmp_path / "rows.kiln").program.narrow.hi == 8


def test_run_artifact_on_random_inputs_at_chosen_size(artifact, capsys):
    rc, out, _ = _run(capsys, "run", artifact, "--size", "T=7", "--repeat", "2")
    assert rc == 0
    assert "sizes: T=7" in out and "inputs: random" in out
    assert "output['h']: f32[7, 8]  mean" in out and "output['norm']: f32[7]" in out
    assert "kiln: first call" in out and "(of 2)" in out and "eager" not in out


def test_run_artifact_default_size_is_the_example(artifact, capsys):
    rc, out, _ = _run(capsys, "run", artifact, "--repeat", "0")
    assert rc == 0 and "sizes: T=6" in out and "f32[6, 8]" in out


def test_run_model_compares_with_eager(model_file, capsys):
    rc, out, _ = _run(capsys, "run", f"{model_file}:make", "--repeat", "0")
    assert rc == 0 and "example args" in out
    errs = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if "rel err" in line]
    assert len(errs) == 2 and max(errs) < 1e-5
    assert re.search(r"kiln: first call [\d.]+ ms; eager: first call [\d.]+ ms", out)


def test_run_model_times_eager_beside_kiln(model_file, capsys):
    rc, out, _ = _run(capsys, "run", f"{model_file}:make", "--repeat", "3")
    assert rc == 0
    line = re.search(r"kiln: first call ([\d.]+) ms, then median ([\d.]+) ms \(of 3\); "
                     r"eager: median ([\d.]+) ms \(kiln/eager ([\d.]+)x\)", out)
    assert line, out
    kiln_ms, eager_ms, ratio = (float(line[i]) for i in (2, 3, 4))
    assert eager_ms > 0
    # the times are printed to 0.01 ms: the ratio of the unrounded ones lies within
    # what the rounding allows (tiny models run in a few hundredths of a millisecond)
    low = max(kiln_ms - 0.005, 0) / (eager_ms + 0.005)
    high = (kiln_ms + 0.005) / max(eager_ms - 0.005, 1e-9)
    assert low - 0.01 <= ratio <= high + 0.01, (kiln_ms, eager_ms, ratio)


def test_explain_artifact_and_model(artifact, model_file, capsys):
    rc, from_artifact, _ = _run(capsys, "explain", artifact)
    assert rc == 0
    rc, from_model, _ = _run(capsys, "explain", f"{model_file}:make")
    assert rc == 0
    assert from_artifact == from_model  # loading changes nothing in the report
    assert "(T) in [2, 40]" in from_artifact and "net.py:" in from_artifact
    rc, with_kernels, _ = _run(capsys, "explain", artifact, "--kernels")
    assert "kernel: torch ops on cpu" in with_kernels
    rc, timed, _ = _run(capsys, "explain", f"{model_file}:make", "--timings")
    assert rc == 0 and timed.startswith(from_model) and "\ncompile time " in timed
    assert "    capture: " in timed and "    decompose: " in timed


def test_compile_to_prints_ir_and_dump_ir_writes_files(model_file, tmp_path, capsys):
    rc, out, err = _run(capsys, "compile", f"{model_file}:make", "--compile-to", "dispatch",
                        "--dump-ir", tmp_path / "ir")
    assert rc == 0 and out.startswith("plan  symbols:") and "stopped after stage dispatch" in err
    assert any(p.name.endswith("form_regions.txt") for p in (tmp_path / "ir").iterdir())
    assert not list(Path.cwd().glob("net.kiln"))


def test_tune_option_reaches_the_compiler(model_file, tmp_path, capsys, monkeypatch):
    seen = []
    real = kiln.compile
    monkeypatch.setattr(kiln, "compile",
                        lambda *a, **k: seen.append(k["options"]) or real(*a, **k))
    assert _run(capsys, "compile", f"{model_file}:make", "--tune", "none", "-o",
                tmp_path / "t.kiln")[0] == 0
    assert seen == [{"tune": "none"}]


def test_builtin_llm_prefill_and_decode(capsys):
    rc, out, _ = _run(capsys, "run", "tiny-llama", "--prompt-len", "4", "--steps", "3")
    assert rc == 0
    assert "generated (3 tokens)" in out and "ms/token" in out
    assert float(out.rsplit("eager PyTorch: ", 1)[1]) < 1e-5
    assert re.search(r"prefill \(4 tokens, same prompt\): kiln [\d.]+ ms, eager [\d.]+ ms "
                     r"\(kiln/eager [\d.]+x\)", out), out
    assert re.search(r"decode per token \(median of 2 steps, same tokens\): kiln [\d.]+ ms, "
                     r"eager [\d.]+ ms \(kiln/eager [\d.]+x\)", out), out


# ---- user mistakes: "kiln: error: ...", exit status 2, no traceback -----------------


def test_missing_model_file(capsys, tmp_path):
    assert "does not exist" in _fails(capsys, "compile", f"{tmp_path}/nope.py:make")


def test_unreadable_model_name(capsys):
    err = _fails(capsys, "run", "resnet")
    assert "cannot read the model name 'resnet'" in err and "tiny-llama" in err


def test_missing_factory_lists_the_functions(model_file, capsys):
    err = _fails(capsys, "compile", f"{model_file}:nope")
    assert "has no function 'nope'" in err and "make" in err


@pytest.mark.parametrize("factory,msg", [("not_a_model", "returned a int as its model"),
                                         ("wrong_shape", "returned str")])
def test_factory_returns_the_wrong_thing(model_file, capsys, factory, msg):
    err = _fails(capsys, "compile", f"{model_file}:{factory}")
    assert msg in err and "the factory must return" in err


def test_factory_that_raises_points_at_its_line(model_file, capsys):
    err = _fails(capsys, "run", f"{model_file}:broken")
    assert "ValueError: the factory broke" in err
    assert "net.py:" in err and 'raise ValueError("the factory broke")' in err


def test_model_file_with_a_syntax_error(tmp_path, capsys):
    (tmp_path / "bad.py").write_text("def make(:\n    pass\n")
    err = _fails(capsys, "compile", f"{tmp_path}/bad.py:make")
    assert "SyntaxError" in err and "bad.py:1" in err


def test_unsupported_op_in_the_model(model_file, capsys, tmp_path):
    rc, _, err = _run(capsys, "compile", f"{model_file}:weird", "-o", tmp_path / "w.kiln")
    assert rc == 0 and "kiln: warning: kiln generates no kernel for aten.erfinv" in err
    assert "net.py:" in err
    err = _fails(capsys, "compile", f"{model_file}:weird", "--fallback", "error")
    assert "erfinv" in err and "net.py:" in err


def test_bad_artifact(tmp_path, capsys):
    (tmp_path / "x.kiln").mkdir()
    assert "has no manifest.json" in _fails(capsys, "run", tmp_path / "x.kiln")


def test_compile_of_an_artifact(artifact, capsys):
    assert "already compiled" in _fails(capsys, "compile", artifact)


def test_unknown_target(model_file, capsys):
    assert "unknown target 'tpu'" in _fails(capsys, "explain", f"{model_file}:make",
                                            "--target", "tpu")


def test_size_outside_bounds_and_unknown_name(artifact, capsys):
    assert "outside the bounds of T: [2, 40]" in _fails(capsys, "run", artifact, "--size",
                                                         "T=41")
    assert "T (s" in _fails(capsys, "run", artifact, "--size", "seq=4")


def test_factory_kwargs_that_are_not_a_dict(model_file, capsys):
    assert "returned kwargs of type int" in _fails(capsys, "compile", f"{model_file}:bad_kwargs")


def test_output_and_dump_paths_blocked_by_a_file(model_file, tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert "a file is in the way" in _fails(capsys, "compile", f"{model_file}:make", "-o",
                                            tmp_path / "f" / "net.kiln")
    assert "cannot write IR dumps" in _fails(capsys, "compile", f"{model_file}:make",
                                             "--dump-ir", tmp_path / "f")


@pytest.mark.parametrize("argv,message", [
    (["run", "tiny-llama", "--prompt-len", "0"], "--prompt-len must be at least 1, got 0"),
    (["run", "tiny-llama", "--steps", "-2"], "--steps must be at least 1, got -2"),
    (["run", "tiny-llama", "--prompt-len", "9999"], "exceeds tiny-llama's context of 128"),
    (["bench", "--device", "cpu", "--preset", "tiny", "--iters", "0"], "--iters must be at "
     "least 1"),
    (["bench", "--device", "cpu", "--preset", "tiny", "--layers", "-1"], "--layers must be "
     "at least 1"),
    (["generate", "--random-weights", "--config", "tiny", "--prompt", "x", "-tp", "0"],
     "tensor_parallel_size must be a positive int, got 0"),
    (["generate", "--random-weights", "--config", "tiny", "--prompt", "x",
      "--max-seq-len", "-5"], "max_seq_len must be a positive int, got -5"),
    (["generate", "--random-weights", "--config", "tiny", "--prompt", "x", "--cache",
      "paged", "--block-size", "0"], "block_size must be a positive int, got 0"),
    (["generate", "--random-weights", "--config", "tiny", "--prompt", "x", "--top-p", "5"],
     "top_p must be in (0, 1], got 5.0"),
])
def test_bad_numbers_fail_before_any_compile(argv, message, capsys):
    assert message in _fails(capsys, *argv)


def test_bench_out_blocked_by_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert "--out" in _fails(capsys, "bench", "--device", "cpu", "--preset", "tiny", "--out",
                             tmp_path / "f")


def test_an_unexpected_exception_is_reported_as_a_kiln_bug(model_file, capsys, monkeypatch):
    import kiln.cli.model_spec as model_spec

    def broken(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(model_spec, "compile_model", broken)
    monkeypatch.setattr("kiln.cli.compile.compile_model", broken)
    rc, _, err = _run(capsys, "compile", f"{model_file}:make")
    assert rc == 3
    assert "Traceback" in err and "kiln: internal error: RuntimeError: planted" in err
    assert "this is a kiln bug" in err


def test_malformed_size_is_a_usage_error(artifact, capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", str(artifact), "--size", "T"])
    assert e.value.code == 2
    assert "expected NAME=N" in capsys.readouterr().err


def test_every_command_has_help(capsys):
    for cmd in ("compile", "run", "explain"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: kiln {cmd}") and "--target" in out


def test_entry_point_help():
    """The `kiln` console script (pyproject: kiln = kiln.cli:main), in a fresh process."""
    assert 'kiln = "kiln.cli:main"' in (REPO / "pyproject.toml").read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "import sys; from kiln.cli import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", code, "--help"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: kiln")
    for cmd in ("compile", "run", "explain"):
        assert cmd in r.stdout


def test_python_m_kiln_cli():
    """`python -m kiln.cli` is the same command (kiln/cli/__main__.py)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "generate"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("kiln: error: name a checkpoint"), r.stderr


def test_version_did_you_mean_and_context_note(capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("kiln 0.")
    assert main(["run", "tiny-lama"]) == 2
    assert "did you mean 'tiny-llama'?" in capsys.readouterr().err
    assert main(["run", "tiny-llama", "--prompt-len", "124", "--steps", "9"]) == 0
    out = capsys.readouterr().out
    assert "note: stopped after 5 of 9 tokens" in out and "128 positions" in out
