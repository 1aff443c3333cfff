"""The tuner's workers start before they are needed, and the run worker loads each
candidate's module once however many jobs time it."""

from kiln.codegen.autotune import run_worker, tuner
from kiln.codegen.build.compiler import Binary, Resources
from kiln.target import get_target


class Pool:
    def __init__(self):
        self.size, self.asked = 3, []

    def prestart(self, count=1):
        self.asked.append(count)


def started(monkeypatch, target, **options):
    pools = {"compile": Pool(), "run": Pool()}
    monkeypatch.setattr(tuner, "get_pool", lambda size=None: pools["compile"])
    monkeypatch.setattr(tuner, "get_run_pool", lambda: pools["run"])
    tuner.start_workers(get_target(target), options)
    return pools["compile"].asked, pools["run"].asked


def test_gpu_target_starts_every_compile_worker(monkeypatch):
    # compile-only here (no GPU of the target's kind): nothing is timed, no run worker
    assert started(monkeypatch, "cuda:sm_90") == ([3], [])


def test_cpu_target_or_planted_compiler_starts_nothing(monkeypatch):
    assert started(monkeypatch, "cpu") == ([], [])
    assert started(monkeypatch, "interpret") == ([], [])
    assert started(monkeypatch, "cuda:sm_90", tune_compiler="tests.x:f") == ([], [])


def binary(code: bytes, name="k") -> Binary:
    return Binary(name, {}, {"cubin": code}, Resources(0, 0, 0), "cubin")


def test_run_worker_reuses_a_loaded_binary_of_the_same_code(monkeypatch):
    monkeypatch.setattr(run_worker, "_LOADED", type(run_worker._LOADED)())
    monkeypatch.setattr(run_worker, "_LOADED_MAX", 2)
    first = binary(b"\x01")
    assert run_worker._loaded(first) is first
    assert run_worker._loaded(binary(b"\x01")) is first  # its module and launcher reused
    assert run_worker._loaded(binary(b"\x01", "other")) is not first
    other = binary(b"\x02")
    assert run_worker._loaded(other) is other
    assert run_worker._loaded(binary(b"\x01")) is not first  # evicted: at most 2 kept


def test_a_failed_compile_stops_the_workers_it_started(monkeypatch):
    import pytest

    counts, stopped = iter([0, 2, 2, 2, 2, 2]), []
    monkeypatch.setattr(tuner, "workers_started", lambda: next(counts))
    monkeypatch.setattr(tuner, "shutdown", lambda: stopped.append(True))
    with pytest.raises(ValueError), tuner.workers_released_on_failure():  # 0 -> 2
        raise ValueError("export failed")
    assert stopped == [True]
    with pytest.raises(ValueError), tuner.workers_released_on_failure():  # 2 -> 2
        raise ValueError("none started by this one: the pool stays")
    with tuner.workers_released_on_failure():  # a compile that works keeps them
        pass
    assert stopped == [True]


class RunPool:
    workers_started = 1

    def __init__(self, events):
        self.events = events

    def close(self, wait=True):
        self.events.append("close")


def test_a_kept_run_worker_outlives_each_compile_inside_and_stops_after(monkeypatch):
    import kiln
    from kiln.codegen.autotune import worker_pool

    events = []
    monkeypatch.setattr(worker_pool, "_run_pool", RunPool(events))
    with kiln.compile_session():
        with worker_pool.run_worker_kept():  # one kiln.compile: a plan, its narrow version
            worker_pool.stop_run_worker()
            worker_pool.stop_run_worker()
        worker_pool.stop_run_worker()  # the next module's plan
        assert events == [] and worker_pool._run_pool is not None
    assert events == ["close"] and worker_pool._run_pool is None
    monkeypatch.setattr(worker_pool, "_run_pool", RunPool(events))
    worker_pool.stop_run_worker()  # outside a session: at once
    assert events == ["close", "close"]


def test_a_plan_and_its_narrow_version_share_the_run_worker(monkeypatch):
    # kiln.compile runs select_kernels twice (the narrow version's passes again); the
    # worker used to stop after the first, and the second's first timing waited ~8 s
    import torch

    import kiln
    from kiln.codegen import select_kernels
    from kiln.codegen.autotune import worker_pool

    events = []
    monkeypatch.setattr(worker_pool, "_run_pool", RunPool(events))
    select = select_kernels._select
    monkeypatch.setattr(select_kernels, "_select",
                        lambda *a: (select(*a), events.append("select"))[0])
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 16)).half()
    x = torch.randn(3, 16, dtype=torch.float16)
    m = kiln.compile(model, (x,), dynamic_shapes=({0: kiln.Dim("b", min=1, max=4)},),
                     target="interpret", options={"compile_cache": False})
    assert m.program.narrow is not None
    assert events == ["select", "select", "close"]


def test_a_compile_worker_imports_no_more_of_kiln_than_it_builds_with():
    """kiln/__init__ binds the compiler's entry points on first use: a worker importing
    kiln.codegen.build does not pull in the pipeline (kiln.api, torch.export's tracer),
    which had made its start 4.0 s instead of 1.6 (a GPU compile starts one a core)."""
    import subprocess
    import sys

    code = ("import sys, kiln.codegen.autotune.compile_worker as w; w._warm_up(); "
            "print(sorted(m for m in ('kiln.api', 'kiln.frontend.export', 'torch._dynamo') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
