"""kiln bench's GPU clock watch (gpu_clock.py): nvidia-smi's samples parsed and summed
up, nothing recorded off GPUs, capped rows named under the table."""

from __future__ import annotations

import json
import os
import stat

from kiln.bench import gpu_clock, report

# nvidia-smi --query-gpu=clocks.sm,power.draw,utilization.gpu,clocks_throttle_reasons.active
# --format=csv,noheader,nounits, as the lent H200 printed it during a prefill 2048 run
CAPPED_RUN = """\
1980, 122.32, 0, 0x0000000000000000
1455, 689.43, 100, 0x0000000000000004
1440, 691.46, 100, 0x0000000000000004
1830, 678.76, 97, 0x0000000000000000
1425, 693.75, 100, 0x0000000000000004
[Unknown Error]
"""


def test_samples_parse_and_the_busy_ones_give_the_clock_and_the_capped_share():
    samples = gpu_clock.parse_samples(CAPPED_RUN)
    assert len(samples) == 5 and samples[1] == (1455.0, 689.43, 100.0, 0x4)
    state = gpu_clock.summary(samples)  # the idle first sample left out
    assert state == {"sm_mhz": 1447.5, "capped": 0.75}


def test_no_busy_sample_no_state():
    assert gpu_clock.summary(gpu_clock.parse_samples("1980, 80.1, 0, 0x1\n")) is None
    assert gpu_clock.summary([]) is None


def test_the_watch_records_nothing_on_the_cpu():
    with gpu_clock.ClockWatch("cpu") as watch:
        pass
    assert watch.state is None


def test_the_watch_reads_what_nvidia_smi_prints_while_it_runs(tmp_path, monkeypatch):
    """A stand-in nvidia-smi that prints the capped run, then waits to be stopped."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"$@\" > " + str(tmp_path / "args") + "\ncat <<'EOF'\n"
                   + CAPPED_RUN + "EOF\nexec sleep 30\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")

    class Props:
        uuid = "58f0b1f5-0000"

    monkeypatch.setattr(gpu_clock.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(gpu_clock.torch.cuda, "get_device_properties", lambda i: Props)
    with gpu_clock.ClockWatch("cuda") as watch:
        import time

        time.sleep(0.5)  # the samples are printed
    assert watch.state == {"sm_mhz": 1447.5, "capped": 0.75}
    assert "--id=GPU-58f0b1f5-0000" in (tmp_path / "args").read_text()


def test_capped_rows_are_named_under_the_table(tmp_path):
    data = {"preset": "tiny", "layers": 2, "dtype": "float16", "device": "GPU",
            "torch": "x", "floors": {"copy_GBps": 4000.0, "matmul_TFLOPs": 700.0},
            "compile_s": {}, "rows": [
                {"key": "prefill 2048 b1", "phase": "prefill", "tokens": 2048, "batch": 1,
                 "floor_ms": 43.0, "ms": {"torch.compile": 60.0, "kiln": 55.3},
                 "rel_err": {}, "host_ms": {},
                 "gpu": {"torch.compile": {"sm_mhz": 1500.0, "capped": 0.9},
                         "kiln": {"sm_mhz": 1447.5, "capped": 0.75}}},
                {"key": "decode 128 b1", "phase": "decode", "tokens": 128, "batch": 1,
                 "floor_ms": 3.6, "ms": {"kiln": 4.2}, "rel_err": {}, "host_ms": {},
                 "gpu": {"kiln": {"sm_mhz": 1980.0, "capped": 0.0}}}]}
    assert report.power_capped(json.loads(json.dumps(data))) == [
        "prefill 2048 b1 torch.compile (1500 MHz)", "prefill 2048 b1 kiln (1448 MHz)"]
    assert "at the power cap" in report.table(data)
    data["rows"][0]["gpu"] = {}
    assert "at the power cap" not in report.table(data)
