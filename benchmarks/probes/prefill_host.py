"""Is a kiln prefill host-bound? kiln bench's Llama compiled as kiln bench compiles it,
then per prompt length: the call timed as kiln bench times it (CUDA events, each call
from an idle device), back to back, the host's enqueue time (wall time of a call, not
waited for), torch.profiler's kernel total; with --steps, the host time of every bound
launch of the program, summed by kernel, and of each ATen call inside torch regions.

Why: kiln bench's 8B prefill 128 ran 6.5-10.3 ms across compiles of the same kernels
(~6 ms of them) for three sessions: the call was host-bound and the lent machine's host
speed varied (benchmarks/RESULTS.md, 2026-11-29 seventeenth session).

    PYTHONPATH=. python benchmarks/probes/prefill_host.py --tokens 128 2048 --steps \\
        --out prefill_host.json
    PYTHONPATH=. python benchmarks/probes/prefill_host.py --device cpu --preset tiny \\
        --tokens 8 16 --steps   # a smoke run
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

import torch

from kiln.bench import subject
from kiln.bench.runners import _kiln_compiled, _torch_compiled
from kiln.bench.timing import back_to_back_ms, host_ms, median_ms
from kiln.codegen import torch_kernel


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_profile(call, top: int = 40) -> tuple[float, list[str]]:
    """(us of kernels a call, the largest kernels) over 3 calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(3):
            call()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / 3, e.count // 3, e.key) for e in p.key_averages()
            if e.device_time_total]
    rows.sort(reverse=True)
    return (sum(r[0] for r in rows),
            [f"{us:9.1f} us x{n:<4d} {key[:90]}" for us, n, key in rows[:top]])


def step_host(module, call, device: str, calls: int = 20) -> list[str]:
    """Host us a call of each bound launch (summed by kernel) and of each ATen call in
    torch regions, over `calls` calls at the sizes `call` binds."""
    program = module.program
    whole, program._whole = program._whole, None  # the CPU target's generated function
    try:
        return _step_host(program, call, device, calls)
    finally:
        program._whole = whole


def _step_host(program, call, device: str, calls: int) -> list[str]:
    call()
    _sync(device)
    bound = next(reversed(program._bound.values()))
    names = []
    for (kernel, _), region in zip(program._steps, program.plan.regions):
        spec = getattr(kernel, "spec", None)
        names.append(f"{kernel.kind} {spec.name if spec else region.kind.value}")
    launches = collections.defaultdict(float)
    ops = collections.defaultdict(float)
    counts = collections.Counter()
    original_steps = list(bound.steps)
    original_op = torch_kernel.BoundOps._step

    def timed_launch(i, launch):
        def run(values, stream):
            t0 = time.perf_counter()
            launch(values, stream)
            launches[i] += time.perf_counter() - t0
        return run

    def timed_op(step, values, local):
        t0 = time.perf_counter()
        original_op(step, values, local)
        key = f"{re.sub(r'_[0-9]+$', '', step[0])} ({step[6]})"
        ops[key] += time.perf_counter() - t0
        counts[key] += 1

    bound.steps[:] = [(timed_launch(i, launch), a, f)
                      for i, (launch, a, f) in enumerate(original_steps)]
    torch_kernel.BoundOps._step = staticmethod(timed_op)
    try:
        for _ in range(calls):
            _sync(device)
            call()
        _sync(device)
    finally:
        bound.steps[:] = original_steps
        torch_kernel.BoundOps._step = staticmethod(original_op)
    by_kernel = collections.defaultdict(lambda: [0.0, 0])
    for i, seconds in launches.items():
        by_kernel[names[i]][0] += seconds / calls * 1e6
        by_kernel[names[i]][1] += 1
    lines = [f"{us:9.1f} us x{n:<4d} {us / n:6.2f} us each  {name}"
             for name, (us, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])]
    lines += [f"  ATen {key:28s} {s / calls * 1e6:8.1f} us a call, "
              f"{s / counts[key] * 1e6:6.2f} us each" for key, s in
              sorted(ops.items(), key=lambda kv: -kv[1])]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(subject.PRESETS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--runner", default="kiln", choices=("kiln", "torch.compile"),
                    help="whose prefill (--steps: kiln only)")
    ap.add_argument("--steps", action="store_true", help="host time of every launch")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dtype = torch.float16 if a.device == "cuda" else torch.float32
    shape = subject.PRESETS[a.preset]
    model = subject.build(shape, dtype, a.device)
    t0 = time.perf_counter()
    compiled = _kiln_compiled if a.runner == "kiln" else _torch_compiled
    module = compiled(model, "prefill", a.device)
    result = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
              "preset": a.preset, "runner": a.runner,
              "compile_s": time.perf_counter() - t0, "rows": []}
    print(f"compiled in {result['compile_s']:.1f} s")
    for tokens in a.tokens:
        ids = torch.randint(0, shape.vocab, (1, tokens), device=a.device)
        pos = torch.arange(tokens, device=a.device)

        def call(ids=ids, pos=pos):
            return module(ids, pos)

        with torch.no_grad():
            row = {"tokens": tokens, "ms": median_ms(call, a.device),
                   "back_to_back_ms": back_to_back_ms(call, a.device, calls=5),
                   "host_ms": host_ms(call, a.device)}
            if a.device == "cuda":
                row["kernel_us"], row["kernels"] = kernel_profile(call)
            if a.steps and a.runner == "kiln":
                row["steps"] = step_host(module, call, a.device)
        result["rows"].append(row)
        host = "" if row["host_ms"] is None else f", host enqueue {row['host_ms']:.3f} ms"
        kernels = f", kernels {row['kernel_us'] / 1e3:.3f} ms" if "kernel_us" in row else ""
        print(f"prefill {tokens}: {row['ms']:.3f} ms (back to back "
              f"{row['back_to_back_ms']:.3f}){host}{kernels}")
        for line in row.get("kernels", []) + row.get("steps", []):
            print("   " + line)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
