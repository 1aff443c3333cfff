"""`kiln bench`: the CPU smoke run CI can afford, the baseline check, bad flags."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from kiln.bench import report, subject
from kiln.bench.floors import Floors
from kiln.bench.sweep import Row
from kiln.cli import main

SMOKE = ["bench", "--device", "cpu", "--preset", "tiny", "--runners", "eager,kiln",
         "--prefill", "12", "--contexts", "20", "--batches", "1,2", "--sweep", "3",
         "--iters", "2"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(SMOKE + ["--out", str(out)]) == 0
    return out, json.loads((out / "bench.json").read_text())


def test_smoke_run_measures_every_row_and_matches_eager(smoke):
    out, data = smoke
    keys = [r["key"] for r in data["rows"]]
    # every runner at batches 1 and 2; the sweep's batch 3 is kiln's decode only
    assert keys == ["prefill 12 b1", "decode 20 b1", "prefill 12 b2", "decode 20 b2",
                    "decode 20 b3"]
    for r in data["rows"][:4]:
        assert set(r["ms"]) == {"eager", "kiln"} and all(v > 0 for v in r["ms"].values())
        assert r["rel_err"]["kiln"] < 1e-5
        assert r["floor_ms"] > 0
    assert set(data["rows"][4]["ms"]) == {"kiln"}
    assert data["floors"]["copy_GBps"] > 0 and data["floors"]["matmul_TFLOPs"] > 0
    text = (out / "bench.txt").read_text()
    assert "kiln/floor" in text and "decode 20 b3" in text
    # what the run was built and launched with, defaults filled in
    assert set(data["settings"]) == {"KILN_TUNE", "KILN_TUNE_TIMING", "KILN_TUNE_OVERLAP",
                                     "KILN_DECOMPOSE", "KILN_PDL", "KILN_FP8_GEMV_PACKED",
                                     "KILN_FP8_GEMM_TMA"}
    assert all(data["settings"].values()) and "settings: KILN_TUNE=" in text


def test_floors_are_the_faster_of_the_start_and_the_end(smoke):
    _, data = smoke
    start, end = data["floors"]["measured"]
    assert data["floors"]["copy_GBps"] == max(start["copy_GBps"], end["copy_GBps"])
    assert data["floors"]["matmul_TFLOPs"] == max(start["matmul_TFLOPs"], end["matmul_TFLOPs"])
    assert "the faster of the start's and the end's" in (smoke[0] / "bench.txt").read_text()


def test_a_row_floor_follows_the_faster_rates():
    slow = Floors(copy_bytes_per_s=1e9, matmul_flops_per_s=1e12)
    fast = Floors(copy_bytes_per_s=2e9, matmul_flops_per_s=4e11, fp8_matmul_flops_per_s=8e12)
    best = slow.best(fast)
    assert (best.copy_bytes_per_s, best.matmul_flops_per_s, best.fp8_matmul_flops_per_s) == (
        2e9, 1e12, 8e12)
    decode = Row("decode", 20, 1, 0.0, work=(4e6, 0.0))
    assert decode.floor_from(slow) == pytest.approx(4.0) and decode.floor_from(best) == 2.0
    # a prefill's floor is its flops or its bytes, whichever takes longer; fp8 at its rate
    prefill = Row("prefill", 12, 1, 0.0, work=(1e6, 4e10))
    assert prefill.floor_from(best) == pytest.approx(40.0)
    fp8 = Row("prefill", 12, 1, 0.0, quantize="fp8", work=(1e6, 4e10))
    assert fp8.floor_from(best) == pytest.approx(5.0)


def test_check_passes_itself_and_fails_a_faster_baseline(smoke, tmp_path, capsys):
    _, data = smoke
    assert report.check(data, data) == []
    faster = json.loads(json.dumps(data))
    faster["rows"][1]["ms"]["kiln"] /= 2
    slower = report.check(data, faster)
    assert len(slower) == 1 and slower[0].startswith("decode 20 b1: kiln")
    # kiln's own figures are the checked ones; a slower peer is not a regression
    peers = json.loads(json.dumps(data))
    peers["rows"][0]["ms"]["eager"] /= 2
    assert report.check(data, peers) == []


def test_check_exits_nonzero_on_a_slowdown(tmp_path, capsys, monkeypatch):
    """...and says where the baseline's settings differ from this run's."""
    monkeypatch.setenv("KILN_PDL", "1")
    base = tmp_path / "base.json"
    rows = [{"key": "decode 20 b1", "ms": {"kiln": 1e-6}}]
    base.write_text(json.dumps({"device": "cpu", "rows": rows,
                                "settings": {"KILN_PDL": "0"}}))
    argv = SMOKE[:] + ["--out", str(tmp_path / "o"), "--check", str(base), "--batches", "1",
                       "--sweep", "", "--prefill", "4"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "slower: decode 20 b1" in err and "1 slower" in err
    assert "settings differ from the baseline's: KILN_PDL 0 there, 1 here" in err


def test_prefill_only_run(tmp_path):
    out = tmp_path / "o"
    argv = SMOKE + ["--out", str(out), "--contexts", "", "--sweep", "", "--batches", "1",
                    "--runners", "eager"]
    assert main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert [r["key"] for r in data["rows"]] == ["prefill 12 b1"]


def test_bad_flags_are_refused_before_measuring(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert main(SMOKE + ["--out", out, "--check", str(tmp_path / "missing.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(SMOKE + ["--out", out, "--runners", "eager,tvm"]) == 2
    assert "unknown runner(s) tvm" in capsys.readouterr().err
    assert main(SMOKE + ["--out", out, "--contexts", "96"]) == 2
    assert "do not fit" in capsys.readouterr().err
    assert main(SMOKE + ["--out", out, "--prefill", "12,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(SMOKE + ["--out", out, "--prefill", "", "--contexts", ""]) == 2
    assert "nothing to measure" in capsys.readouterr().err
    assert main(SMOKE + ["--out", out, "--quantize", "fp8", "--runners", "eager"]) == 2
    assert "leaves kiln out" in capsys.readouterr().err
    assert main(SMOKE + ["--out", out, "--contexts", ""]) == 2  # the sweep is decode
    assert "--sweep ''" in capsys.readouterr().err
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    assert main(SMOKE + ["--out", out, "--check", str(garbage)]) == 2
    assert "not a kiln bench JSON" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_batched_subject_shares_weights_and_matches_batch_one():
    s = subject.PRESETS["tiny"]
    base = subject.build(s, torch.float32, "cpu")
    two = subject.with_batch(base, 2)
    assert two.layers[0].wqkv.weight is base.layers[0].wqkv.weight
    assert two.layers[0].k_cache.shape[0] == 2 and base.layers[0].k_cache.shape[0] == 1
    ids = torch.randint(0, s.vocab, (2, 5))
    with torch.no_grad():
        both = two(ids, torch.arange(5))
        first = base(ids[:1], torch.arange(5))
    torch.testing.assert_close(both[:1], first)


@pytest.fixture(scope="module")
def fp8_smoke(tmp_path_factory):
    """A --quantize fp8 run checked against a baseline that has only the dtype's rows:
    (exit code, bench.json, stderr)."""
    out = tmp_path_factory.mktemp("bench_fp8")
    base = out / "base.json"
    base.write_text(json.dumps({"device": "cpu", "rows": [
        {"key": "decode 20 b1", "ms": {"kiln": 1e9}}]}))
    argv = SMOKE + ["--out", str(out), "--batches", "1", "--sweep", "", "--prefill", "",
                    "--quantize", "fp8", "--check", str(base)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, json.loads((out / "bench.json").read_text()), err.getvalue()


def test_fp8_rows_beside_the_dtype_rows(fp8_smoke):
    code, data, err = fp8_smoke
    keys = [r["key"] for r in data["rows"]]
    assert keys == ["decode 20 b1", "decode 20 b1 fp8"]
    assert data["quantize"] == "fp8"
    for r in data["rows"][1:]:
        assert r["quantize"] == "fp8" and set(r["ms"]) == {"kiln"}  # eager: untimed
        assert r["rel_err"]["kiln"] < 1e-5  # kiln's fp8 model against the same run eagerly
    assert set(report.quantized_ratios(data)) == {"decode 20 b1 fp8"}
    assert "kiln fp8 / float32: decode 20 b1 fp8" in report.table(data)
    assert report.FP8_ERR_NOTE in report.table(data)  # what its error column means
    # the baseline has no fp8 rows: they are reported, and the run passes
    assert code == 0, err
    assert "not in the baseline (not checked): decode 20 b1 fp8" in err


def test_check_compares_fp8_rows_when_the_baseline_has_them(fp8_smoke):
    _, data, _ = fp8_smoke
    faster = json.loads(json.dumps(data))
    faster["rows"][1]["ms"]["kiln"] /= 2
    slower = report.check(data, faster)
    assert len(slower) == 1 and slower[0].startswith("decode 20 b1 fp8: kiln")
    assert report.unchecked(data, faster) == []


def test_fp8_subject_quantises_the_projections_and_shares_the_rest():
    s = subject.PRESETS["tiny"]
    base = subject.build(s, torch.float32, "cpu")
    fp8 = subject.quantize_fp8(base)
    for layer in fp8.layers:
        for name in subject.FP8_PROJECTIONS:
            proj = getattr(layer, name)
            assert isinstance(proj, subject.Fp8Linear) and proj.weight.dtype == torch.float8_e4m3fn
    assert fp8.tok_embeddings.weight is base.tok_embeddings.weight
    assert fp8.layers[0].k_cache is not base.layers[0].k_cache
    assert subject.weight_bytes(fp8, 1) < subject.weight_bytes(base, 1) / 2
    two = subject.with_batch(fp8, 2)
    assert two.layers[0].wqkv.weight is fp8.layers[0].wqkv.weight
    ids = torch.randint(0, s.vocab, (2, 5))
    with torch.no_grad():
        both, first = two(ids, torch.arange(5)), fp8(ids[:1], torch.arange(5))
        plain = base(ids[:1], torch.arange(5))
    torch.testing.assert_close(both[:1], first)
    assert 0 < ((first - plain).norm() / plain.norm()).item() < 0.1  # fp8's own error


def test_fp8_subject_runs_kilns_generated_fp8_kernel_in_every_projection():
    """On a GPU target the fp8 rows time kiln's own fp8 GEMM: each projection's extern
    region is a generated Triton kernel (here on the interpret target), equal to eager."""
    import kiln
    from kiln.ir.plan import RegionKind

    s = subject.PRESETS["tiny"].with_(layers=1, max_len=16)
    fp8 = subject.quantize_fp8(subject.build(s, torch.float32, "cpu"))
    args = (torch.randint(0, s.vocab, (1, 1)), torch.tensor([3]))
    exe = kiln.compile(fp8, args, target="interpret")
    extern = [r for r in exe.program.plan.regions if r.kind == RegionKind.EXTERN]
    assert len(extern) == len(subject.FP8_PROJECTIONS)
    assert all(type(exe.program.kplan.kernels[r.name]).__name__ == "TritonKernel"
               for r in extern)
    with torch.no_grad():
        want = subject.quantize_fp8(subject.build(s, torch.float32, "cpu"))(*args)
        got = exe(*args)
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_back_to_back_ms_is_the_time_a_call_of_many_queued():
    """On the CPU: wall clock over the calls, a call's share (the figure the slices'
    decode steps report, generate's way of running them)."""
    import time

    from kiln.bench.timing import back_to_back_ms

    calls = []
    ms = back_to_back_ms(lambda: (calls.append(1), time.sleep(0.002)), "cpu", calls=5,
                         reps=3, warmup=1)
    assert len(calls) == 1 + 5 * 3
    assert 1.9 <= ms <= 20


def test_host_bound_rows_are_named(smoke):
    """A GPU run records each call's host enqueue time; a row whose host time reaches 90%
    of its call is named host-bound under the table (the CPU smoke run records none)."""
    _, data = smoke
    assert all(r["host_ms"] == {} for r in data["rows"])
    assert "host-bound" not in report.table(data)
    gpu = json.loads(json.dumps(data))
    gpu["rows"][0]["ms"] = {"eager": 20.0, "kiln": 6.4}
    gpu["rows"][0]["host_ms"] = {"eager": 5.0, "kiln": 6.1}
    gpu["rows"][1]["host_ms"] = {"kiln": 0.1}
    assert report.host_bound(gpu) == ["prefill 12 b1 kiln (host 6.1 of 6.4 ms)"]
    assert "host-bound (the host's enqueue >= 90% of the call" in report.table(gpu)


def test_host_ms_is_none_off_gpus():
    from kiln.bench.timing import host_ms

    assert host_ms(lambda: None, "cpu") is None
