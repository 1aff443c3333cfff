"""Probe: does the autotuner charge the extern form its host time? (issue 10, prefill 2048)

In kiln bench's model the attention output projection with its residual add (wo + x,
4096 x 4096, fp16) ran kiln's own Triton tile at ~560 TFLOP/s at 2048 tokens where cuBLAS
runs ~700 (an H200, twelfth session): the tuner chose at 512 tokens (timing.TUNE_SIZE),
where it timed the tile 0.0353 ms and the extern 0.0654 ms. The extern is the region run
op by op from Python (TorchKernel: mm, add, copies into the planned outputs), timed as
every candidate is, by do_bench's events around each call: if its host work outlasts its
kernels, the GPU idles inside the timed span. Here, for that region compiled by kiln
(tune fast) at each length: the tuner's note, then each form's time the tuner's way
(timing.timed_ms), the same forms replayed in a CUDA graph (device time only), and the
eager op for reference.

GPU: PYTHONPATH=. python benchmarks/probes/extern_timing.py [--lengths 512 2048] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch import nn

import kiln
from kiln.codegen.autotune.timing import example_buffers, timed_ms
from kiln.codegen.torch_kernel import TorchKernel

DIM = 4096


class Wo(nn.Module):
    def __init__(self):
        super().__init__()
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, y, x):
        return x + self.wo(y)


def graph_ms(fn, reps: int = 20) -> float:
    """Device time of fn, replayed `reps` times in one CUDA graph, per call."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 5 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 2048])
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["KILN_COMPILE_CACHE"] = "0"
    os.environ["KILN_CACHE_DIR"] = tempfile.mkdtemp()
    dev, dt = "cuda", torch.float16
    m = Wo().to(dev, dt)
    rows = []
    for t in args.lengths:
        y, x = (torch.randn(t, DIM, device=dev, dtype=dt) for _ in range(2))
        exe = kiln.compile(m, (y, x), target="cuda", options={"tune": "fast"})
        prog = exe.program
        plan = prog.kplan.plan
        region = max(plan.regions, key=lambda r: len(r.ops))
        chosen = prog.kplan.kernels[region.name]
        note = next((n for n in region.notes if n.startswith(("tuned", "extern"))), "")
        env = dict(exe.example_sizes or {})
        inputs, outs = example_buffers(region, plan, env, dev)
        extern = TorchKernel(region, dev)
        row = {"t": t, "note": note[:400], "chosen": getattr(chosen, "kind", "?")}
        for name, k in (("chosen", chosen), ("extern", extern)):
            row[f"{name}_tuner_ms"] = timed_ms(k, inputs, outs, env)
            row[f"{name}_graph_ms"] = graph_ms(
                lambda k=k, i=inputs, o=outs, e=env: k.run(i, o, e))
        row["eager_graph_ms"] = graph_ms(lambda y=y, x=x: m(y, x))
        row["gflop"] = 2 * t * DIM * DIM / 1e9
        rows.append(row)
        print(f"T {t}: tuner's timing chosen {row['chosen_tuner_ms']:.4f} / extern "
              f"{row['extern_tuner_ms']:.4f} ms; in a graph chosen {row['chosen_graph_ms']:.4f}"
              f" / extern {row['extern_graph_ms']:.4f} / eager {row['eager_graph_ms']:.4f} ms",
              flush=True)
        print(f"  {note[:300]}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
