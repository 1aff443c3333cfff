"""Milliseconds per call, the same way for every runner on a device.

The median of many calls after a warm-up: on a GPU timed with CUDA events around each
call (what the device did, launch gaps included); on the CPU with the wall clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: str, warmup: int = 3, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
