"""The floors every figure is read against, measured in the same run.

A decode step must read its bytes (weights, KV cache) at least once: bytes / copy
bandwidth. A prefill must do its flops: flops / the rate of a large matmul in the
model's dtype (or its bytes, if that is more); an fp8 model's at the rate of an fp8
matmul (torch._scaled_mm) where the device has one. Measured, not taken from a
datasheet, so a throttled or shared device moves the floor with the runners.

Each rate is the fastest of a few rounds, and `kiln bench` measures them again at the end
of its run and keeps the faster (`Floors.best`): the floor is what the device can do.
One measurement at the start once read 4007 GB/s where the same H200 read 4210 minutes
later (benchmarks/RESULTS.md, thirty-eighth session), which made kiln's decode look 5%
nearer its floor than it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.bench.timing import median_ms


@dataclass(frozen=True)
class Floors:
    copy_bytes_per_s: float  # bytes read + written per second by a device copy
    matmul_flops_per_s: float  # a large square matmul in the model's dtype
    fp8_matmul_flops_per_s: float | None = None  # torch._scaled_mm, e4m3 (CUDA only)

    def bytes_ms(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_per_s * 1e3

    def flops_ms(self, flops: float, fp8: bool = False) -> float:
        """At the fp8 rate for an fp8 model where it was measured (the CPU runs fp8
        weights dequantised: the dtype's rate is its floor)."""
        rate = self.fp8_matmul_flops_per_s if fp8 and self.fp8_matmul_flops_per_s \
            else self.matmul_flops_per_s
        return flops / rate * 1e3

    def best(self, other: Floors) -> Floors:
        """Each rate the faster of the two measurements."""
        fp8 = [r for r in (self.fp8_matmul_flops_per_s, other.fp8_matmul_flops_per_s) if r]
        return Floors(max(self.copy_bytes_per_s, other.copy_bytes_per_s),
                      max(self.matmul_flops_per_s, other.matmul_flops_per_s),
                      max(fp8) if fp8 else None)


ROUNDS = 3  # medians per rate; the fastest is kept


def measure(device: str, dtype: torch.dtype, small: bool = False, fp8: bool = False
            ) -> Floors:
    """Copy bandwidth over 1 GiB (64 MiB when `small`) and an n^3 matmul rate (n = 8192,
    or 512 when `small`: a CPU smoke run should take seconds); with `fp8`, on CUDA,
    the rate of an n^3 e4m3 torch._scaled_mm too. Each the fastest of ROUNDS medians."""
    nbytes = (64 if small else 1024) << 20
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = _fastest(lambda: b.copy_(a), device, iters=10 if small else 30)
    n = 512 if small else 8192
    x = torch.randn(n, n, device=device).to(dtype)
    y = torch.randn(n, n, device=device).to(dtype)
    mm_ms = _fastest(lambda: x @ y, device, iters=10 if small else 20)
    fp8_rate = None
    if fp8 and device == "cuda":
        xq, yq = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fp8_ms = _fastest(lambda: torch._scaled_mm(xq, yq, one, one, out_dtype=dtype),
                          device, iters=20)
        fp8_rate = 2 * n ** 3 / (fp8_ms * 1e-3)
    return Floors(copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3),
                  matmul_flops_per_s=2 * n ** 3 / (mm_ms * 1e-3),
                  fp8_matmul_flops_per_s=fp8_rate)


def _fastest(fn, device: str, iters: int) -> float:
    return min(median_ms(fn, device, warmup=5, iters=iters) for _ in range(ROUNDS))
