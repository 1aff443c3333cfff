"""What the kernel benchmarks measure with: relative error, median time (triton's
do_bench on a GPU, wall clock elsewhere) and the device's copy bandwidth, the floor
every byte-bound figure is divided by. One definition, so their ratios compare."""

from __future__ import annotations

import time

import torch


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timed_ms(fn, device, reps: int = 5) -> float:
    """Median milliseconds of `fn`: triton's do_bench on a GPU, wall clock elsewhere."""
    if device == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device) -> float | None:
    """Bytes per second of a device-to-device copy of 1 GiB (read + write counted)."""
    if device != "cuda":
        return None
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device)
    return 2 * n / (ms * 1e-3)
