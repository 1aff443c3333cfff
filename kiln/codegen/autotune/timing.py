"""Timing candidates on the GPU: which compiled config (or the extern torch form) is fastest.

Only when a GPU of the target's kind is present (compile-only tuning has nothing to
time). Each candidate runs on the same random inputs at the example's sizes, through
the same `Kernel.run` the runtime uses, and is measured with triton.testing.do_bench
(warm-up, then the median). As in TorchInductor's select_algorithm, the extern form
(cuBLAS / SDPA through torch) is always a candidate, and a candidate that fails to
run counts as infinitely slow rather than failing the compile.

Integer inputs are zeros and boolean ones are all true: random integers would make
out-of-range indices, and a device-side fault poisons the whole CUDA context. The
tuner runs all this in its run worker (run_worker.py), so a candidate that faults
anyway poisons that process's context, not the compiling one's: buffers are described
here (Buffers) and made where they are used (make_buffers).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from statistics import median

import torch

from kiln.errors import KilnError
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import evaluate, parse
from kiln.target import Target, detect_cuda

log = logging.getLogger("kiln.codegen")

WARMUP_MS, REP_MS = 25, 40  # an unscreened timing (in-process, at the power cap)
# Screening (tuner._time_all): every candidate first runs for SCREEN_REP_MS; one slower
# than PRUNE_RATIO x the fastest screened keeps that time, the others run on to
# SCREENED_REP_MS in all (the screen's samples count). Why: an 8B generation compile
# timed ~500 candidates at 100 ms of runs each (H200: 64.7 s with screening at 2x), while
# a run of a decode kernel with do_bench's L2 clear before it is ~70 us: 5 ms is ~70
# samples and 20 ms ~280, whose median is within a few percent. Halving the budget
# again (10 / 40 ms before) took 12 s off an 8B LLM's timing (43 -> 32 s, H200)
# and moved no choice more than re-running the same compile does (22 of 35 kernels'
# picks differ between two identical runs: near-ties); a kernel 1.5x slower than the
# fastest screen does not win.
SCREEN_WARMUP_MS, SCREEN_REP_MS = 2, 5
SCREENED_REP_MS = 20
PRUNE_RATIO = 1.5


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


SMALL_RANGE = 64  # a dynamic dim bounded this low is a decode batch: both ends matter


def low_env(region: Region, plan: DispatchPlan, env: dict[str, int]) -> dict[str, int] | None:
    """`env` with each small-ranged dynamic dim of the region at its lower bound, or
    None when the region has none.

    Such a dim is a decode step's batch, whose every size is captured as a CUDA graph:
    timed at its top only (timing_env), a 4-row bucket picked cuBLAS for the 8B's down
    projection, which then ran at 1 row in 42 us against the GEMV's 27.5 (H100).
    """
    out, names = dict(env), set(region_symbols(region, plan))
    for name, b in plan.symbols.items():
        if name in names and b.hi is not None and b.lo != b.hi and b.hi <= SMALL_RANGE:
            out[name] = max(1, int(b.lo or 1))
    return out if out != env else None


# A prompt-length dim (dynamic, its range past SMALL_RANGE) of a matmul or attention
# region is timed at TUNE_SIZE, and its finalists (within FINALIST_RATIO of the fastest
# there, and the torch form) again at TOP_SIZE and at BOTTOM_SIZE within its bounds: a
# tile chosen at 512 rows alone is not the one a 2048-token prompt wants (kiln bench's
# 8B prefill 2048 on an H200, tune fast: 55.3-57.3 ms in some compiles, 65.6-66.8 in
# others, where tune none ran 58.6; one winner at 512, within noise of the next, was
# far behind it at 2048; with the top timed, 56.5 in two compiles), nor always the one
# a short prompt wants (prefill 128 in those two compiles: 6.6 and 10.1 ms).
TOP_SIZE = 2048
BOTTOM_SIZE = 128
FINALIST_RATIO = 1.25
_SIZED_KINDS = ("matmul", "attention")


def _prompt_env(region: Region, plan: DispatchPlan, env: dict[str, int],
                size: int) -> dict[str, int] | None:
    """`env` with each prompt-length dim of a matmul or attention region at `size`
    within its bounds, or None when that changes nothing (or the region has a decode
    batch's dim: low_env)."""
    if region.kind.value not in _SIZED_KINDS:
        return None
    out, names = dict(env), set(region_symbols(region, plan))
    for name, b in plan.symbols.items():
        if name not in names or name not in out or b.lo == b.hi:
            continue
        if b.hi is not None and b.hi <= SMALL_RANGE:
            return None  # a decode batch: both ends, low_env's way
        at = size if b.hi is None else min(b.hi, size)
        out[name] = max(int(b.lo or 1), at)
    return out if out != env else None


def top_env(region: Region, plan: DispatchPlan, env: dict[str, int]) -> dict[str, int] | None:
    """`env` with each prompt-length dim of a matmul or attention region at TOP_SIZE
    within its bounds (never below `env`'s), or None when the region has none."""
    out = _prompt_env(region, plan, env, TOP_SIZE)
    if out is None or any(out[k] < env[k] for k in out):
        return None
    return out


def bottom_env(region: Region, plan: DispatchPlan,
               env: dict[str, int]) -> dict[str, int] | None:
    """`env` with each prompt-length dim at BOTTOM_SIZE within its bounds (never above
    `env`'s), or None when the region has none below `env`."""
    out = _prompt_env(region, plan, env, BOTTOM_SIZE)
    if out is None or any(out[k] > env[k] for k in out):
        return None
    return out


def sizes_bucket(region: Region, plan: DispatchPlan, env: dict[str, int]) -> str:
    """The example's sizes, each rounded up to a power of two: nearby sizes share a choice."""
    parts = []
    for s in region_symbols(region, plan):
        n = int(env[s])
        parts.append(f"{s}={1 << max(0, n - 1).bit_length()}")
    return ",".join(parts) or "static"


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: str,
            gen: torch.Generator | None = None) -> torch.Tensor:
    if dtype.itemsize == 1 and dtype.is_floating_point:  # fp8: no randn of its own
        return torch.randn(shape, device=device, generator=gen).to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype, device=device, generator=gen)
    if dtype == torch.bool:
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _choices(shape: tuple[int, ...], n: int, device: str,
             gen: torch.Generator | None = None) -> torch.Tensor:
    """Per row (the last dim), distinct random values below n: a router's expert
    choices (a row has at most n of them; the rest repeat)."""
    rows = math.prod(shape[:-1])
    picks = torch.rand(rows, n, device=device, generator=gen).argsort(-1)[:, :shape[-1]]
    if picks.shape[-1] < shape[-1]:
        picks = picks.repeat(1, -(-shape[-1] // max(1, n)))[:, :shape[-1]]
    return picks.reshape(shape)


# random floats reshaped into the range an op's operand has in models (a fill kind's
# value is unused): a recurrence fed keys of norm ~sqrt(K) and growing gates overflows,
# and the tuner's output check (verify.py) then checks nothing
SHAPED = {
    "unit_rows": lambda x: torch.nn.functional.normalize(x, dim=-1),  # l2-normalised keys
    "log_decay": lambda x: -torch.nn.functional.softplus(x),  # log of a decay in (0, 1)
    "unit_interval": torch.sigmoid,  # a gate such as the delta rule's beta
}


@dataclass(frozen=True)
class Buffers:
    """What the timing buffers are, with no tensor in it: it travels to the run worker,
    which makes the tensors in its own CUDA context (make_buffers).

    inputs / outputs: value name -> (shape, dtype); fill: input name -> an integer
    value, or ("choose_from", n) for distinct random values below n per row; inplace:
    output -> the input it is written over (verify.outputs)."""

    inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    outputs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    fill: dict[str, int | tuple[str, int]]
    inplace: dict[str, str | None] = field(default_factory=dict)


def inplace_inputs(region: Region) -> dict[str, str | None]:
    """The region's outputs written in place over a state: output -> the input it is
    written over, or None where the region writes the state without reading it (a KV
    cache write whose rows come from other values: the cache is no input of its)."""
    return {o: s if s in region.inputs else None for o, s in region.inplace.items()
            if o in region.outputs}


def buffer_specs(region: Region, plan: DispatchPlan, env: dict[str, int],
                 fill: dict[str, str] | None = None) -> Buffers:
    """The shapes and dtypes of `region`'s inputs and outputs at the sizes in `env`,
    and the values of its integer inputs.

    Integer inputs are zeros (always valid indices) unless `fill` (a template's
    KernelSpec.meta["timing_fill"]: input -> size expression, {"choose_from": size
    expression} for distinct random values per row, or {"even_offsets": size expression} for
    cumulative row counts sharing that many rows evenly over the input's length,
    {"sequence_bounds": size expression} for packed sequences' bounds from 0 to it; a float
    input {kind: "1"} for a kind of SHAPED) gives them values: a decode kernel's positions
    at zero would time a one-key attention, a MoE kernel's expert ids at zero one expert, a
    grouped GEMM's offsets one expert's rows (or none), and the tuner would pick the config
    that is fastest at doing nothing, or at work the model never does."""
    def meta(v):
        tv = plan.values.get(v)
        shape, dtype = (tv.shape, tv.dtype) if tv else (region.op(v).shape, region.op(v).dtype)
        return tuple(int(evaluate(d, env)) for d in shape), dtype

    values = {}
    for v, how in (fill or {}).items():
        if v in region.inputs:
            values[v] = (tuple((k, int(evaluate(parse(e), env))) for k, e in how.items())[0]
                         if isinstance(how, dict) else int(evaluate(parse(how), env)))
    return Buffers({v: meta(v) for v in region.inputs},
                   {o: meta(o) for o in region.outputs}, values, inplace_inputs(region))


def make_buffers(b: Buffers, device: str, seed: int = 0):
    """Random inputs (the same for the same seed) and empty outputs, on `device`."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inputs = {v: _random(shape, dtype, device, gen) for v, (shape, dtype) in b.inputs.items()}
    for v, how in b.fill.items():
        if isinstance(how, tuple) and how[0] == "even_offsets":
            n = inputs[v].numel()
            ends = torch.arange(1, n + 1, device=device) * how[1] // max(1, n)
            inputs[v].copy_(ends.reshape(inputs[v].shape))
        elif isinstance(how, tuple) and how[0] == "sequence_bounds":  # packed, [0 .. S]
            n = inputs[v].numel()
            bounds = torch.arange(n, device=device) * how[1] // max(1, n - 1)
            inputs[v].copy_(bounds.reshape(inputs[v].shape))
        elif isinstance(how, tuple) and how[0] in SHAPED:
            inputs[v].copy_(SHAPED[how[0]](inputs[v].float()))
        elif isinstance(how, tuple):  # ("choose_from", n): each row distinct values below n
            inputs[v].copy_(_choices(inputs[v].shape, how[1], device, gen))
        else:
            inputs[v].fill_(how)
    outs = {o: torch.empty(shape, dtype=dtype, device=device)
            for o, (shape, dtype) in b.outputs.items()}
    return inputs, outs


def example_buffers(region: Region, plan: DispatchPlan, env: dict[str, int], device: str,
                    fill: dict[str, str] | None = None):
    """Random inputs and empty outputs for `region` at the sizes in `env` (buffer_specs)."""
    return make_buffers(buffer_specs(region, plan, env, fill), device)


def timed_ms(kernel, inputs, outs, env) -> float:
    """Median milliseconds of `kernel.run`; whatever the run raises propagates."""
    return median(timed_samples(kernel, inputs, outs, env, WARMUP_MS, REP_MS))


def timed_samples(kernel, inputs, outs, env, warmup_ms: float, rep_ms: float) -> list[float]:
    """Milliseconds of each timed `kernel.run` (do_bench's, L2 cleared before each),
    after `warmup_ms` of runs, for about `rep_ms` in all."""
    from triton.testing import do_bench

    def run():
        kernel.run(inputs, outs, env)

    run()  # loads the binary; launch errors surface here
    torch.cuda.synchronize()
    return [float(t) for t in do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="all")]


def bench(kernel, inputs, outs, env) -> float:
    """Median milliseconds of `kernel.run` (math.inf when it fails to run)."""
    try:
        return timed_ms(kernel, inputs, outs, env)
    except Exception as e:  # a candidate that cannot run is infinitely slow
        log.info("timing %s failed: %s", getattr(kernel, "config", "extern"), e)
        return math.inf
