"""Probe: does a prefill GEMM's ranking hold when the GPU runs at its power cap?

kiln bench's 8B prefill 2048 on an H200 (eighteenth session): kiln's matmul tiles took
48.1 ms of the call where torch.compile's cuBLAS kernels took 43.5, though the tuner
had timed the tiles level with cuBLAS at 2048 rows. nvidia-smi showed why it might be:
a prefill 2048 run back to back holds the card at its power cap (~690 W, SM clock
~1450 MHz, throttle reason SW power cap) while the tuner times each candidate for tens
of milliseconds with idle gaps (do_bench: an L2 flush between calls) at ~1980 MHz. A
kernel that draws more power a FLOP loses speed under the cap.

Here, for each of the 8B's prefill products at T tokens (wqkv, wo + residual, w13,
w2 + residual, the LM head): kiln's Triton tile (the chosen config under the tune mode
given, or the template's default with --tune none) and the torch form (cuBLAS), each
timed the tuner's way at the top (power_cap.SUSTAINED: do_bench after a warm-up) and
for `--seconds` of back-to-back calls, the last half timed with events, the SM clock
and power read (nvidia-smi) while the queue is still full. Forms alternate twice a shape;
--dynamic compiles the token dim dynamic, as a prefill module's tiles are.

GPU: PYTHONPATH=. python benchmarks/probes/sustained_gemm.py [--tokens 2048]
    [--seconds 1.0] [--shapes w13 w2] [--out f.json]
CPU smoke: ... --device cpu --tokens 16 --seconds 0.05 --shapes wo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time

import torch
from torch import nn

import kiln
from kiln.codegen.autotune import power_cap
from kiln.codegen.autotune.timing import REP_MS, example_buffers, median, timed_samples
from kiln.codegen.torch_kernel import TorchKernel

SHAPES = {  # name: (in features, out features, residual add)
    "wqkv": (4096, 6144, False),
    "wo": (4096, 4096, True),
    "w13": (4096, 28672, False),
    "w2": (14336, 4096, True),
    "lm_head": (4096, 128256, False),
}


class Product(nn.Module):
    def __init__(self, k: int, n: int, residual: bool):
        super().__init__()
        self.w = nn.Linear(k, n, bias=False)
        self.residual = residual

    def forward(self, x, r):
        y = self.w(x)
        return y + r if self.residual else y


def gpu_state() -> str:
    """The SM clock, power and throttle reasons now (nvidia-smi), or ''."""
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def sustained_ms(fn, seconds: float, device: str) -> tuple[float, str]:
    """(ms a call over the second half of `seconds` of back-to-back calls, the GPU's
    state read while that half still runs)."""
    fn()
    if device != "cuda":
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            fn()
            n += 1
        return (time.perf_counter() - t0) / n * 1e3, ""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-5)
    half = max(3, int(seconds / 2 / one))
    for _ in range(half):  # the first half: the card settles at what this form draws
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(half):
        fn()
    end.record()
    state = gpu_state()  # read while the second half is queued and running
    torch.cuda.synchronize()
    return start.elapsed_time(end) / half, state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--tune", default="fast", choices=("none", "fast"))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--warmups", nargs="+", type=int, default=[power_cap.SUSTAIN_MS],
                    help="the tuner's way after each of these warm-ups (ms): is a shorter "
                    "one as faithful?")
    ap.add_argument("--dynamic", action="store_true",
                    help="the token dim dynamic (as in a prefill module), not static")
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ["KILN_COMPILE_CACHE"] = "0"
    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp())
    dt = torch.float16 if a.device == "cuda" else torch.float32
    rows = []
    for name in a.shapes:
        k, n, residual = SHAPES[name]
        m = Product(k, n, residual).to(a.device, dt)
        x = torch.randn(a.tokens, k, device=a.device, dtype=dt)
        r = torch.randn(a.tokens, n, device=a.device, dtype=dt)
        seq = kiln.Dim("seq", min=2, max=max(4096, a.tokens))
        dims = {"dynamic_shapes": ({0: seq}, {0: seq})} if a.dynamic else {}
        exe = kiln.compile(m, (x, r), target=a.device, options={"tune": a.tune}, **dims)
        plan = exe.program.kplan.plan
        region = max(plan.regions, key=lambda g: len(g.ops))
        chosen = exe.program.kplan.kernels[region.name]
        note = next((t for t in region.notes if t.startswith(("tuned", "extern", "["))), "")
        env = dict(exe.example_sizes or {})
        inputs, outs = example_buffers(region, plan, env, a.device)  # randn, as the tuner's
        forms = {"chosen": chosen, "torch": TorchKernel(region, a.device)}
        if getattr(chosen, "kind", "") != "triton" and a.tune != "none":
            # the torch form won: kiln's tile is the template's default (tune none)
            tile = kiln.compile(m, (x, r), target=a.device, options={"tune": "none"}, **dims)
            biggest = max(tile.program.kplan.plan.regions, key=lambda g: len(g.ops))
            forms["tile"] = tile.program.kplan.kernels[biggest.name]
        row = {"shape": name, "k": k, "n": n, "tokens": a.tokens, "dynamic": a.dynamic,
               "chosen": getattr(chosen, "kind", "?"),
               "config": str(getattr(chosen, "config", "")), "note": note[:600],
               "tile_config": str(getattr(forms.get("tile"), "config", ""))}
        gflop = 2 * a.tokens * k * n / 1e9
        for rnd in range(2):
            for form, kern in forms.items():
                def call(kern=kern, inputs=inputs, outs=outs, env=env):
                    kern.run(inputs, outs, env)
                if a.device == "cuda":  # the tuner's way at the top (power_cap.py)
                    for warm in a.warmups:  # power_cap.SUSTAIN_MS and cheaper ones
                        row.setdefault(f"{form}_tuner_{warm}ms", []).append(median(
                            timed_samples(kern, inputs, outs, env, warm, REP_MS)))
                ms, state = sustained_ms(call, a.seconds, a.device)
                row.setdefault(f"{form}_sustained_ms", []).append(ms)
                row.setdefault(f"{form}_state", []).append(state)
                print(f"{name} T {a.tokens} {form:6s} round {rnd}: sustained {ms:.4f} ms "
                      f"({gflop / ms:.0f} TFLOP/s) [{state}]", flush=True)
        tuner = "".join(f" {f} after {w} ms {row[f'{f}_tuner_{w}ms']}" for f in forms
                        for w in a.warmups if f"{f}_tuner_{w}ms" in row)
        print(f"{name}: chosen {row['chosen']} {row['config']}; tuner's timing (ms):"
              f"{tuner}", flush=True)
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if a.device == "cuda"
                       else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
