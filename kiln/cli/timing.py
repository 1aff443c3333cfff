"""Timing for `kiln run`: each call on its own clock (a GPU synchronised), and kiln's times
beside eager PyTorch's on the same calls, so a user sees at once whether kiln helps."""

from __future__ import annotations

import statistics
import time

import torch
import torch.utils._pytree as pytree


def timed_calls(fn, n: int, device: torch.device) -> tuple[object, list[float]]:
    """Call fn() n times (at least once), without autograd; (first output, seconds each)."""
    first, times = None, []
    with torch.no_grad():
        for i in range(max(n, 1)):
            t0 = time.perf_counter()
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
            first = out if i == 0 else first
    return first, times


def to_device(tree, device: torch.device):
    """Every tensor of a pytree of arguments on `device`."""
    return pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, tree)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def side_by_side(kiln_times: list[float], eager_times: list[float] | None) -> str:
    """'kiln: first call X ms, then median Y ms (of N); eager: median Z ms (kiln/eager
    R x)'. Medians leave out each side's first call (kiln's loads kernels, eager's warms
    PyTorch's ops); with no repeats the first calls stand alone."""
    line = f"kiln: first call {_ms(kiln_times[0])}"
    rest = kiln_times[1:]
    if rest:
        line += f", then median {_ms(statistics.median(rest))} (of {len(rest)})"
    if eager_times is None:
        return line
    eager_rest = eager_times[1:]
    if not rest or not eager_rest:
        return line + f"; eager: first call {_ms(eager_times[0])}"
    k, e = statistics.median(rest), statistics.median(eager_rest)
    return line + f"; eager: median {_ms(e)} (kiln/eager {k / e:.2f}x)"


def versus(label: str, kiln_times: list[float], eager_times: list[float]) -> str:
    """'label: kiln X ms, eager Y ms (kiln/eager R x)', medians of calls timed alike."""
    k, e = statistics.median(kiln_times), statistics.median(eager_times)
    return f"{label}: kiln {_ms(k)}, eager {_ms(e)} (kiln/eager {k / e:.2f}x)"
