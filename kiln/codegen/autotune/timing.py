"""Timing candidates on the GPU: which compiled config (or the extern torch form) is fastest.

Only when a GPU of the target's kind is present (compile-only tuning has nothing to
time). Each candidate runs on the same random inputs at the example's sizes, through
the same `Kernel.run` the runtime uses, and is measured with triton.testing.do_bench
(warm-up, then the median). As in TorchInductor's select_algorithm, the extern form
(cuBLAS / SDPA through torch) is always a candidate, and a candidate that fails to
run counts as infinitely slow rather than failing the compile.

Integer inputs are zeros and boolean ones are all true: random integers would make
out-of-range indices, and a device-side fault poisons the whole CUDA context.
"""

from __future__ import annotations

import logging
import math

import torch

from kiln.errors import KilnError
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import evaluate, parse
from kiln.target import Target, detect_cuda

log = logging.getLogger("kiln.codegen")

WARMUP_MS, REP_MS = 25, 100


def gpu_for(target: Target) -> bool:
    """Whether this machine has a GPU of `target`'s kind (same backend and architecture)."""
    if not target.is_gpu or not torch.cuda.is_available():
        return False
    try:
        local = detect_cuda()
    except KilnError:
        return False
    return local.backend == target.backend and local.arch == target.arch


def region_symbols(region: Region, plan: DispatchPlan) -> list[str]:
    """The size symbols the region's inputs and outputs depend on."""
    names: set[str] = set()
    for v in [*region.inputs, *region.outputs]:
        tv = plan.values.get(v)
        for d in tv.shape if tv else region.op(v).shape:
            names.update(str(s) for s in getattr(d, "free_symbols", ()))
    return sorted(names)


TUNE_SIZE = 512  # a dynamic dim is timed at this size (a typical prompt), within bounds


def timing_env(plan: DispatchPlan, env: dict[str, int]) -> dict[str, int]:
    """The sizes to time kernels at: the example's, each dynamic dim raised toward
    TUNE_SIZE within its bounds. An export example is often tiny (8 or 16 tokens): timed
    there, a prefill GEMM picks 16-row tiles that a 512-token prompt then runs
    (measured on an H200: the Llama-3 head 1.05 ms vs cuBLAS's 0.75)."""
    out = dict(env)
    for name, b in plan.symbols.items():
        if name in out and b.hi != b.lo:
            top = TUNE_SIZE if b.hi is None else min(b.hi, TUNE_SIZE)
            out[name] = max(int(out[name]), top)
    return out


def sizes_bucket(region: Region, plan: DispatchPlan, env: dict[str, int]) -> str:
    """The example's sizes, each rounded up to a power of two: nearby sizes share a choice."""
    parts = []
    for s in region_symbols(region, plan):
        n = int(env[s])
        parts.append(f"{s}={1 << max(0, n - 1).bit_length()}")
    return ",".join(parts) or "static"


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    if dtype.itemsize == 1 and dtype.is_floating_point:  # fp8: no randn of its own
        return torch.randn(shape, device=device).to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _choices(shape: tuple[int, ...], n: int, device: str) -> torch.Tensor:
    """Per row (the last dim), distinct random values below n: a router's expert
    choices (a row has at most n of them; the rest repeat)."""
    rows = math.prod(shape[:-1])
    picks = torch.rand(rows, n, device=device).argsort(-1)[:, :shape[-1]]
    if picks.shape[-1] < shape[-1]:
        picks = picks.repeat(1, -(-shape[-1] // max(1, n)))[:, :shape[-1]]
    return picks.reshape(shape)


def example_buffers(region: Region, plan: DispatchPlan, env: dict[str, int], device: str,
                    fill: dict[str, str] | None = None):
    """Random inputs and empty outputs for `region` at the sizes in `env`.

    Integer inputs are zeros (always valid indices) unless `fill` (a template's
    KernelSpec.meta["timing_fill"]: input -> size expression, or {"choose_from": size
    expression} for distinct random values per row) gives them values: a decode
    kernel's positions at zero would time a one-key attention, and a MoE kernel's
    expert ids at zero one expert, and the tuner would pick the config that is fastest
    at doing nothing."""
    def meta(v):
        tv = plan.values.get(v)
        shape, dtype = (tv.shape, tv.dtype) if tv else (region.op(v).shape, region.op(v).dtype)
        return tuple(evaluate(d, env) for d in shape), dtype

    inputs = {v: _random(*meta(v), device) for v in region.inputs}
    for v, how in (fill or {}).items():
        if v not in inputs:
            continue
        if isinstance(how, dict):  # {"choose_from": n}: each row distinct values below n
            inputs[v].copy_(_choices(inputs[v].shape, evaluate(parse(how["choose_from"]), env),
                                     device))
        else:
            inputs[v].fill_(evaluate(parse(how), env))
    outs = {o: torch.empty(meta(o)[0], dtype=meta(o)[1], device=device)
            for o in region.outputs}
    return inputs, outs


def bench(kernel, inputs, outs, env) -> float:
    """Median milliseconds of `kernel.run` (math.inf when it fails to run)."""
    from triton.testing import do_bench

    def run():
        kernel.run(inputs, outs, env)

    try:
        run()  # loads the binary; launch errors surface here
        torch.cuda.synchronize()
        return float(do_bench(run, warmup=WARMUP_MS, rep=REP_MS, return_mode="median"))
    except Exception as e:  # a candidate that cannot run is infinitely slow
        log.info("timing %s failed: %s", getattr(kernel, "config", "extern"), e)
        return math.inf
