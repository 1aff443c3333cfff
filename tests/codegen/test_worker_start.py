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
