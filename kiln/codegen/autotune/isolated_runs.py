"""The tuner's side of the run worker: time and check one region's candidates there.

Why (issue 13): a candidate that faults on the GPU poisons the CUDA context of the
process it runs in, so the compiling process must never run one. Each candidate's
timing, and each check of its outputs, is one job for the process's run worker
(worker_pool.get_run_pool, run_worker.py), made of what describes it (the region,
the spec, the config, its binary, the buffers' shapes and dtypes), never of tensors.
Jobs are small and the worker lives for the whole compile (started while the first
timed region compiles, stopped by select_kernels at the end, so its CUDA context and
memory do not stay beside the compiled model), so a candidate costs its timing plus a
pipe round trip; a worker that faulted, crashed or hung is replaced before the next job.

A run ends as one of:
    a number / a verdict   the candidate ran
    Ran.fault              it faulted, crashed its worker or hung: the tuner
                           quarantines it as runtime_fault
    Ran.error              it raised and the context survived: it cannot run here
                           (timed as infinitely slow, as in-process timing does)
    NoRunWorker            no run worker could start: nothing can be timed; the
                           tuner decides untimed
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kiln.codegen.autotune.run_worker import FAULT
from kiln.codegen.autotune.timing import Buffers
from kiln.codegen.autotune.worker_pool import CRASH, HANG, NO_WORKER, OK, get_run_pool
from kiln.codegen.build.compiler import Binary
from kiln.codegen.build.spec import Config, KernelSpec
from kiln.ir.plan import Region

DEFAULT_RUNNER = "kiln.codegen.autotune.run_worker:measure"
DEFAULT_RUN_TIMEOUT = 60.0  # seconds a timing (or a check) may take before it is a hang
SEED = 0  # every job makes the same inputs: a check compares like with like


class NoRunWorker(Exception):
    """The run worker could not start (a broken environment, not a candidate)."""


@dataclass
class Ran:
    value: object = None  # the median ms ("time"), or the mismatch or None ("verify")
    # each timed run's ms, when the timing had a budget (a screen, or the rest after
    # one); None from a runner that reports the median only
    samples: list[float] | None = None
    fault: str | None = None
    error: str | None = None


@dataclass
class RunJob:
    what: str  # "time" or "verify"
    task: dict
    runner: str

    def message(self) -> dict:
        return {"fn": self.runner, "task": {"what": self.what, **self.task}}


def run_device() -> str:
    """The device the compiling process would have timed on (its current CUDA device)."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return "cuda"


class IsolatedRuns:
    """Times and checks candidates of one region, at one set of sizes, in the run worker."""

    def __init__(self, region: Region, spec: KernelSpec, buffers: Buffers,
                 sizes: dict[str, int], runner: str = DEFAULT_RUNNER,
                 timeout: float = DEFAULT_RUN_TIMEOUT):
        region = dataclasses.replace(region, notes=[])  # what it is, not its history
        self.base = {"region": region, "buffers": buffers, "sizes": dict(sizes),
                     "device": run_device(), "seed": SEED}
        self.spec = spec.to_json()
        self.runner = runner
        self.timeout = timeout

    def time(self, config: Config | None, binary: Binary | None,
             budget: tuple[float, float] | None = None) -> Ran:
        """The candidate's median ms (config None: the region's torch form); with a
        budget ((warmup ms, rep ms): a screen, or the rest of a timing) its samples too."""
        return self._run("time", config, binary, budget)

    def verify(self, config: Config, binary: Binary) -> Ran:
        """Why the candidate's outputs differ from the torch form's (None: they agree)."""
        return self._run("verify", config, binary)

    def _run(self, what: str, config: Config | None, binary: Binary | None,
             budget: tuple[float, float] | None = None) -> Ran:
        task = {**self.base, "spec": None, "config": None, "binary": None}
        if budget is not None:
            task["budget"] = list(budget)
        if config is not None:  # never ship a loaded kernel: the worker loads its own
            task.update(spec=self.spec, config=config.to_json(),
                        binary=dataclasses.replace(binary, _kernels={}))
        ((_, out),) = get_run_pool().run([RunJob(what, task, self.runner)], self.timeout)
        key = "ms" if what == "time" else "mismatch"
        if out.status == OK and isinstance(out.result, dict) and key in out.result:
            return Ran(value=out.result[key], samples=out.result.get("samples"))
        if out.status == OK:
            return Ran(error=f"the runner's reply has no {key!r}: {out.result!r}"[:300])
        if out.status == NO_WORKER:
            raise NoRunWorker(out.reason)
        if out.status in (FAULT, CRASH, HANG):
            return Ran(fault=out.reason)
        return Ran(error=out.reason)
