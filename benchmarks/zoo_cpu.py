"""The zoo (tests/zoo) timed: kiln's compile time and per-call time beside eager, on the
CPU target (or --target cuda on a GPU), one line per model.

    PYTHONPATH=. python benchmarks/zoo_cpu.py [--target cuda]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch

import kiln
from kiln.errors import KilnWarning
from kiln.ir.ops import is_fallback
from tests.zoo.test_zoo import CASES, HF_LMS, _first, _hf, _rel


def _median_ms(fn, args, kwargs, device: str, iters: int = 20) -> float:
    fn(*args, **kwargs)
    times = []
    for _ in range(iters):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", default="cpu")
    args = p.parse_args()
    device = "cuda" if args.target.startswith("cuda") else "cpu"
    cases = dict(CASES)
    for name, make in HF_LMS.items():
        cases[name] = (lambda make=make: (_hf(*make()), lambda: (
            torch.randint(0, 100, (2, 9)),)))
    print(f"{'model':22}{'compile s':>10}{'kiln ms':>10}{'eager ms':>10}{'kiln/eager':>11}"
          f"{'rel err':>10}  fallbacks")
    for name, make in cases.items():
        model, make_args = make()
        model = model.eval().to(device)
        kwargs = {"use_cache": False} if name in HF_LMS else {}
        a = tuple(t.to(device) for t in make_args())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KilnWarning)  # listed in the last column
            t0 = time.perf_counter()
            exe = kiln.compile(model, a, kwargs, target=args.target)
            compile_s = time.perf_counter() - t0
        fallen = sorted({op.target.split(".")[1] for r in exe.plan.regions for op in r.ops
                         if is_fallback(op.target)})
        with torch.no_grad():
            k = _median_ms(exe, a, kwargs, device)
            e = _median_ms(model, a, kwargs, device)
            err = _rel(_first(exe(*a, **kwargs)), _first(model(*a, **kwargs)))
        print(f"{name:22}{compile_s:10.2f}{k:10.3f}{e:10.3f}{k / e:11.2f}{err:10.1e}  "
              f"{', '.join(fallen) or '-'}")


if __name__ == "__main__":
    main()
