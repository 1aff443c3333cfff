"""The floors every figure is read against, measured in the same run.

A decode step must read its bytes (weights, KV cache) at least once: bytes / copy
bandwidth. A prefill must do its flops: flops / the rate of a large matmul in the
model's dtype (or its bytes, if that is more). Measured, not taken from a datasheet, so
a throttled or shared device moves the floor with the runners.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.bench.timing import median_ms


@dataclass(frozen=True)
class Floors:
    copy_bytes_per_s: float  # bytes read + written per second by a device copy
    matmul_flops_per_s: float  # a large square matmul in the model's dtype

    def bytes_ms(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_per_s * 1e3

    def flops_ms(self, flops: float) -> float:
        return flops / self.matmul_flops_per_s * 1e3


def measure(device: str, dtype: torch.dtype, small: bool = False) -> Floors:
    """Copy bandwidth over 1 GiB (64 MiB when `small`) and an n^3 matmul rate (n = 8192,
    or 512 when `small`: a CPU smoke run should take seconds)."""
    nbytes = (64 if small else 1024) << 20
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    copy_ms = median_ms(lambda: b.copy_(a), device, warmup=5, iters=30)
    n = 512 if small else 8192
    x = torch.randn(n, n, device=device).to(dtype)
    y = torch.randn(n, n, device=device).to(dtype)
    mm_ms = median_ms(lambda: x @ y, device, warmup=5, iters=20)
    return Floors(copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3),
                  matmul_flops_per_s=2 * n ** 3 / (mm_ms * 1e-3))
