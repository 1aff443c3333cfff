"""The GPU's SM clock and power-cap state while a row is timed (nvidia-smi, sampled).

Why: a long prefill holds a GPU at its power cap, and there every compute-bound kernel
runs slower than at boost clocks: kiln bench's 8B prefill 2048 ran the H200 at ~1450 of
its 1980 MHz (throttle reason: SW power cap), torch.compile's at ~1500, while the
floors' matmul is timed in short bursts at boost clocks (benchmarks/RESULTS.md,
eighteenth session). A row's milliseconds and its ratio to the floor read differently
when its runner ran capped, so the bench records each runner's clock per row and the
report names the capped ones.

A `nvidia-smi --query-gpu ... -lms` process samples while the row is timed; where
nvidia-smi is missing (or on the CPU) the watch records nothing.
"""

from __future__ import annotations

import shutil
import signal
import statistics
import subprocess

import torch

PERIOD_MS = 100
QUERY = "clocks.sm,power.draw,utilization.gpu,clocks_throttle_reasons.active"
SW_POWER_CAP = 0x4  # nvidia-smi's clocks_throttle_reasons bit for the software power cap
BUSY_UTIL = 50  # % utilization: a sample of the row's work, not of an idle gap
CAPPED = 0.5  # the share of busy samples at the power cap that makes a row "capped"


def parse_samples(text: str) -> list[tuple[float, float, float, int]]:
    """(SM MHz, W, utilization %, throttle reasons) of each line of nvidia-smi's
    `--format=csv,noheader,nounits` output; lines that do not parse are skipped."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 4:
            continue
        try:
            out.append((float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16)))
        except ValueError:
            continue
    return out


def summary(samples: list[tuple[float, float, float, int]]) -> dict | None:
    """{"sm_mhz": median clock, "capped": share at the power cap} over the busy samples,
    or None when none was busy (a row too short for one sample)."""
    busy = [s for s in samples if s[2] >= BUSY_UTIL]
    if not busy:
        return None
    return {"sm_mhz": statistics.median(s[0] for s in busy),
            "capped": sum(bool(s[3] & SW_POWER_CAP) for s in busy) / len(busy)}


class ClockWatch:
    """`with ClockWatch(device) as w: ...`; then w.state is summary()'s dict or None."""

    def __init__(self, device: str):
        self.device, self.state, self._proc = device, None, None

    def __enter__(self) -> ClockWatch:
        smi = shutil.which("nvidia-smi")
        if self.device != "cuda" or smi is None:
            return self
        # line-buffered (a pipe would get nvidia-smi's output in 4 KB blocks, and a
        # short row's samples could be lost with the process)
        line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []
        cmd = [*line_buffered, smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
               f"--loop-ms={PERIOD_MS}"]
        uuid = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()),
                       "uuid", None)
        if uuid is not None:  # torch prints it bare, nvidia-smi names it GPU-<uuid>
            uuid = str(uuid)
            cmd.append(f"--id={uuid if uuid.startswith('GPU-') else 'GPU-' + uuid}")
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGINT)  # as Ctrl-C ends its loop: output flushed
        try:
            text, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            text, _ = self._proc.communicate()
        self.state = summary(parse_samples(text or ""))
