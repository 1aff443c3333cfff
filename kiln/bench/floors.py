"""The floors every figure is read against, measured in the same run.

A decode step must read its bytes (weights, KV cache) at least once: bytes / copy
bandwidth. A prefill must do its flops: flops / the rate of a large matmul in the
model's dtype (or its bytes, if that is more); an fp8 model's at the rate of an fp8
matmul (torch._scaled_mm) where the device has one. Measured, not taken from a
datasheet, so a throttled or shared device moves the floor with the runners.
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


def measure(device: str, dtype: torch.dtype, small: bool = False, fp8: bool = False
            ) -> Floors:
    """Copy bandwidth over 1 GiB (64 MiB when `small`) and an n^3 matmul rate (n = 8192,
    or 512 when `small`: a CPU smoke run should take seconds); with `fp8`, on CUDA,
    the rate of an n^3 e4m3 torch._scaled_mm too."""
    nbytes = (64 if small else 1024) << 20
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda: b.copy_(a), device, warmup=5, iters=30)
    n = 512 if small else 8192
    x = torch.randn(n, n, device=device).to(dtype)
    y = torch.randn(n, n, device=device).to(dtype)
    mm_ms = median_ms(lambda: x @ y, device, warmup=5, iters=20)
    fp8_rate = None
    if fp8 and device == "cuda":
        xq, yq = x.to(torch.float8_e4m3fn), y.to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        fp8_ms = median_ms(lambda: torch._scaled_mm(xq, yq, one, one, out_dtype=dtype),
                           device, warmup=5, iters=20)
        fp8_rate = 2 * n ** 3 / (fp8_ms * 1e-3)
    return Floors(copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3),
                  matmul_flops_per_s=2 * n ** 3 / (mm_ms * 1e-3),
                  fp8_matmul_flops_per_s=fp8_rate)
