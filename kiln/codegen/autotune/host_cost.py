"""A candidate's host cost, added to its GPU time where no CUDA graph hides it.

Why: a module with a prompt-length dim (a prefill) runs without CUDA graphs (kiln masks
rather than pads, so no captured size fits another prompt), and each call launches
every kernel from Python. At short prompts the host is the bottleneck: Llama-3-8B's
prefill of 128 tokens on the lent H200 ran ~6.0 ms of kernels behind 7-10 ms of host
work (the host's speed varied that much between processes), so its time followed the
host's, 6.5-10.3 ms. The tuner's timings (do_bench, the L2 cleared before each run)
see GPU time only, and there the extern form (cuBLAS through ATen) wins near-ties; but
in that program each of its ATen calls took ~15-30 us of host (mm, add, index; views
of weights and planned buffers are kept from call to call, torch_kernel.MEMO_VIEWS)
against ~10 us for a kiln launch: the 8B's 96 extern matmul regions took ~5 ms of the
prefill's host time.

So where a region has a prompt-length dim, each candidate is scored by its GPU time
plus its host time: the extern form's ATen calls at EXTERN_CALL_MS each, a kiln kernel's
launch at LAUNCH_MS (the lent H200 host's in-program figures, rounded down). Only where
the host binds: a matmul or attention region's timing at 128 rows (timing.bottom_env;
at 512 and 2048 a prefill is GPU-bound, and with the host cost there too the 8B's
prefill 2048 ran ~1% slower), or a smaller kernel's at its only timing. A region whose
dims are static or a decode batch's (every size a CUDA graph) is scored by GPU time
alone. Measured (H200, fresh compiles): prefill 128 6.45-10.3 ms before, host-bound;
6.40 / 6.46 ms with host cost everywhere, GPU-bound (host 2.5 ms).
"""

from __future__ import annotations

from kiln.codegen.autotune.timing import SMALL_RANGE, region_symbols
from kiln.codegen.torch_kernel import MEMO_VIEWS
from kiln.ir.plan import DispatchPlan, Region

EXTERN_CALL_MS = 0.015
LAUNCH_MS = 0.010


def host_exposed(region: Region, plan: DispatchPlan) -> bool:
    """Whether `region` has a prompt-length dim: dynamic, its range past a decode
    batch's, so the module that runs it is not replayed as CUDA graphs."""
    for name in region_symbols(region, plan):
        b = plan.symbols.get(name)
        if b is not None and b.lo != b.hi and (b.hi is None or b.hi > SMALL_RANGE):
            return True
    return False


def extern_calls(region: Region) -> int:
    """The ATen calls the extern form makes per run (views of inputs are kept)."""
    return sum(op.target not in MEMO_VIEWS and op.target != "getitem" for op in region.ops)


def with_host_cost(times: dict, region: Region) -> dict:
    """`times` (config -> GPU ms; None: the extern form) plus each one's host ms."""
    extern = extern_calls(region) * EXTERN_CALL_MS
    return {c: t + (extern if c is None else LAUNCH_MS) for c, t in times.items()}


def describe(region: Region) -> str:
    """The note saying what was added."""
    return (f"host cost added (a prompt-length dim, no CUDA graph): extern "
            f"{extern_calls(region)} ATen calls x {EXTERN_CALL_MS} ms, kiln {LAUNCH_MS} ms")
