"""The phases `kiln bench` measures, in one process: prefill at each length, decode at
each context, for each batch size, every runner on the same module; then kiln's decode
throughput over a sweep of batch sizes. Each row carries its floor and the runners'
errors against eager, so a fast wrong answer cannot pass unnoticed. With `quantize`
("fp8") kiln's batches are measured again on the model with kiln's fp8 projections
(subject.quantize_fp8): rows keyed "... fp8", beside the dtype's rows, checked
against the same fp8 model run eagerly (untimed: see _batch).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import torch

from kiln.bench import subject
from kiln.bench.floors import Floors, measure
from kiln.bench.gpu_clock import ClockWatch
from kiln.bench.runners import RUNNERS, Runner
from kiln.bench.timing import host_ms, median_ms


@dataclass
class Plan:
    device: str = "cpu"
    preset: str = "tiny"
    dtype: torch.dtype = torch.float32
    layers: int | None = None
    prefill: tuple[int, ...] = (16, 64)
    contexts: tuple[int, ...] = (16, 64)
    batches: tuple[int, ...] = (1, 2)
    sweep: tuple[int, ...] = ()
    runners: tuple[str, ...] = RUNNERS
    iters: int = 20
    quantize: str | None = None  # "fp8": fp8 rows too

    def shape(self) -> subject.Shape:
        s = subject.PRESETS[self.preset]
        return s.with_(layers=self.layers) if self.layers else s


@dataclass
class Row:
    phase: str  # "prefill" or "decode"
    tokens: int  # prompt length, or the decode step's context
    batch: int
    floor_ms: float
    ms: dict[str, float] = field(default_factory=dict)
    rel_err: dict[str, float] = field(default_factory=dict)
    quantize: str | None = None  # "fp8": the model with fp8 projections
    host_ms: dict[str, float] = field(default_factory=dict)  # GPUs: a call's enqueue time
    gpu: dict[str, dict] = field(default_factory=dict)  # GPUs: SM clock, power cap (gpu_clock)
    work: tuple[float, float] = (0.0, 0.0)  # (bytes, flops) the floor is made of

    def floor_from(self, floors: Floors) -> float:
        """The row's floor at `floors`' rates: its bytes at the copy rate, a prefill's
        flops at the matmul rate (an fp8 model's at the fp8 rate) if those take longer."""
        nbytes, flops = self.work
        return max(floors.bytes_ms(nbytes),
                   floors.flops_ms(flops, fp8=self.quantize == "fp8") if flops else 0.0)

    @property
    def key(self) -> str:
        tag = f" {self.quantize}" if self.quantize else ""
        return f"{self.phase} {self.tokens} b{self.batch}{tag}"


@dataclass
class Result:
    plan: Plan
    floors: Floors  # the faster of the start's and the end's measurements, per rate
    rows: list[Row] = field(default_factory=list)
    compile_s: dict[str, float] = field(default_factory=dict)  # "runner phase bB[ fp8]" -> s
    device_name: str = ""
    measured: list[Floors] = field(default_factory=list)  # at the start, at the end


def run(plan: Plan, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Result:
    s = plan.shape()
    too_long = [n for n in (*plan.prefill, *plan.contexts) if n >= s.max_len]
    if too_long:
        raise ValueError(f"lengths {too_long} do not fit the cache of {s.max_len} positions")
    device_name = (torch.cuda.get_device_name() if plan.device == "cuda"
                   else "cpu")
    dtype = str(plan.dtype).removeprefix("torch.")
    log(f"kiln bench: {plan.preset} ({s.layers} layers, {dtype}) on {device_name}")
    floors = _floors(plan, log, "start")
    result = Result(plan, floors, device_name=device_name, measured=[floors])
    base = subject.build(s, plan.dtype, plan.device)
    bases = {None: base}
    if plan.quantize == "fp8":
        bases["fp8"] = subject.quantize_fp8(base)
    for batch in dict.fromkeys(plan.batches + plan.sweep):
        runners = plan.runners if batch in plan.batches else ("kiln",)
        contexts = plan.contexts if batch in plan.batches else plan.contexts[:1]
        prefill = plan.prefill if batch in plan.batches else ()
        for quantize, model in bases.items():
            if quantize and batch not in plan.batches:
                continue  # the throughput sweep is the dtype's only
            _batch(result, subject.with_batch(model, batch), batch, runners, prefill,
                   contexts, log, quantize)
            gc.collect()
            if plan.device == "cuda":
                torch.cuda.empty_cache()
    # the floors again, once the runs have warmed the device: each rate the faster
    end = _floors(plan, log, "end")
    result.measured.append(end)
    result.floors = floors.best(end)
    for row in result.rows:
        row.floor_ms = row.floor_from(result.floors)
    return result


def _floors(plan: Plan, log, when: str) -> Floors:
    f = measure(plan.device, plan.dtype, small=plan.device != "cuda",
                fp8=plan.quantize == "fp8")
    log(f"  floors ({when}): copy {f.copy_bytes_per_s / 1e9:.0f} GB/s, matmul "
        f"{f.matmul_flops_per_s / 1e12:.1f} TFLOP/s"
        + (f", fp8 {f.fp8_matmul_flops_per_s / 1e12:.1f}" if f.fp8_matmul_flops_per_s
           else ""))
    return f


def _batch(result: Result, model, batch: int, names, prefill, contexts, log,
           quantize: str | None = None) -> None:
    plan, s, floors = result.plan, result.plan.shape(), result.floors
    # fp8 rows: torch.compile would only wrap kiln.ops' opaque fp8 op (its PyTorch form,
    # a per-128-block loop of fp32 matmuls), and eager runs that form: a correctness
    # oracle, not a speed peer. Eager runs once, untimed, as the reference for the error.
    runners = [Runner(n, model, plan.device) for n in names
               if not quantize or n != "torch.compile"]
    tag = f" {quantize}" if quantize else ""
    gen = torch.Generator(device="cpu").manual_seed(batch)
    cases = [("prefill", t) for t in prefill] + [("decode", c) for c in contexts]
    for phase, tokens in cases:
        if phase == "prefill":
            ids = torch.randint(0, s.vocab, (batch, tokens), generator=gen)
            pos = torch.arange(tokens)
            work = (subject.weight_bytes(model, batch), subject.matmul_flops(s, batch, tokens))
        else:
            ids = torch.randint(0, s.vocab, (batch, 1), generator=gen)
            pos = torch.tensor([tokens])
            work = (subject.weight_bytes(model, batch)
                    + subject.kv_bytes(s, batch, tokens, plan.dtype), 0.0)
        ids, pos = ids.to(plan.device), pos.to(plan.device)
        row = Row(phase, tokens, batch, 0.0, quantize=quantize, work=work)
        row.floor_ms = floor = row.floor_from(floors)
        ref = None
        for r in runners:
            with torch.no_grad():
                out = _first_call(r, phase, ids, pos, result.compile_s, f"b{batch}{tag}")
                if r.name == "eager":
                    ref = out.float()
                elif ref is not None:
                    row.rel_err[r.name] = float((out.float() - ref).norm() / ref.norm())
                if not (quantize and r.name == "eager"):
                    with ClockWatch(plan.device) as watch:
                        row.ms[r.name] = _time(r.step(phase), ids, pos, plan)
                    if watch.state is not None:
                        row.gpu[r.name] = watch.state
                    host = host_ms(partial(r.step(phase), ids, pos), plan.device)
                    if host is not None:
                        row.host_ms[r.name] = host
        result.rows.append(row)
        log("  " + row.key + ": " + ", ".join(f"{n} {ms:.3f} ms" for n, ms in row.ms.items())
            + f" (floor {floor:.3f} ms at the start's rates)")


def _time(step, ids, pos, plan: Plan) -> float:
    return median_ms(lambda: step(ids, pos), plan.device, iters=plan.iters)


def _first_call(r: Runner, phase: str, ids, pos, compile_s: dict, which: str):
    """Run once; a runner's first call of a phase (its compile) is timed into compile_s
    under "runner phase `which`" (which: "b4", "b4 fp8")."""
    key = f"{r.name} {phase} {which}"
    first = key not in compile_s
    t0 = time.perf_counter()
    out = r.step(phase)(ids, pos)
    if first:
        if r.device == "cuda":
            torch.cuda.synchronize()
        compile_s[key] = time.perf_counter() - t0
    return out
