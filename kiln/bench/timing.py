"""Milliseconds per call, the same way for every runner on a device.

The median of many calls after a warm-up: on a GPU timed with CUDA events around each
call (what the device did, launch gaps included); on the CPU with the wall clock.
Each timed call starts on an idle device, so the host's work before its first kernel
is in the figure; `back_to_back_ms` times calls queued one after another, as the
generate loop runs decode steps (decode_ahead.py), the host's work then overlapping
the device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], device: str, warmup: int = 3, iters: int = 20) -> float:
    """Milliseconds a call of `fn`, each call timed on its own: the median of `iters`."""
    return back_to_back_ms(fn, device, calls=1, reps=iters, warmup=warmup)


def back_to_back_ms(fn: Callable[[], object], device: str, calls: int = 20,
                    reps: int = 10, warmup: int = 3) -> float:
    """Milliseconds a call of `fn`, `calls` of them launched back to back between two
    events (the wall clock on the CPU): the median over `reps` such runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    times.sort()
    return times[len(times) // 2]


def host_ms(fn: Callable[[], object], device: str, iters: int = 10) -> float | None:
    """Milliseconds of host work a call takes to enqueue (its wall time, the device idle
    at its start and not waited for): where this reaches the call's median_ms the call
    is host-bound, and faster kernels would not make it faster (the 8B's prefill 128
    was, for three sessions of unexplained spread: benchmarks/RESULTS.md, seventeenth
    session). None off GPUs, where a call's wall time is its host time."""
    if device != "cuda":
        return None
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
