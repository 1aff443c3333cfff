"""A small pool of worker processes: each job runs in a separate process, with a deadline.

Why (DESIGN.md failure 5): a Triton config aborted in Triton's C++ and took the whole
process down. Here a compile that aborts ends its worker only (the job comes back as a
"crash" with the signal and the tail of the worker's stderr); a compile that passes
its deadline has its worker killed (a "hang"). Either way the worker is replaced on
demand and the other jobs carry on.

Two kinds of worker serve through this machinery: compile workers (compile_worker.py,
get_pool) and the run worker that times and checks candidates on the GPU in a CUDA
context of its own (run_worker.py, get_run_pool: a kernel that faults poisons only
its worker's context). A worker whose reply says it retires (its CUDA context is
lost) is replaced before it gets another job.

Workers are fresh interpreters (`python -m kiln.codegen.autotune.compile_worker`), never forks:
the parent may hold a CUDA context, and multiprocessing's spawn would re-run the user's
__main__. Starting one costs seconds (torch + Triton), so one pool serves the whole
process (all regions, all compiles), is grown lazily up to its size, and is stopped at
exit. A job's deadline starts when a ready worker receives it, so start-up time never
counts as a hang.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

from kiln.codegen.autotune.compile_worker import FORWARDED_ENV
from kiln.codegen.build.compiler import Binary
from kiln.codegen.build.spec import Config, KernelSpec
from kiln.target import Target

OK, ERROR, OVER_LIMIT, CRASH, HANG = "ok", "error", "over_limit", "crash", "hang"
NO_WORKER = "no_worker"  # the pool could not start a worker: not the config's fault
COMPILE_WORKER = "kiln.codegen.autotune.compile_worker"
RUN_WORKER = "kiln.codegen.autotune.run_worker"
STARTUP_TIMEOUT = 300.0  # seconds for a worker to import torch and Triton
_KILN_ROOT = str(Path(__file__).resolve().parents[3])


@dataclass
class Job:
    spec: KernelSpec
    config: Config
    target: Target
    compile_fn: str  # "package.module:function", called as fn(spec, config, target)

    def message(self) -> dict:
        """What a compile worker is sent (compile_worker.run_job reads it)."""
        return {"fn": self.compile_fn, "spec": self.spec.to_json(),
                "config": self.config.to_json(), "target": self.target}


@dataclass
class Outcome:
    status: str  # OK, ERROR, OVER_LIMIT, CRASH, HANG or NO_WORKER (run jobs: FAULT too)
    binary: Binary | None = None
    reason: str = ""
    seconds: float = 0.0
    result: dict | None = None  # a run job's reply ("ms", "mismatch")


class _Worker:
    def __init__(self, module: str = COMPILE_WORKER):
        fd, self.log = tempfile.mkstemp(prefix="kiln-tune-worker-", suffix=".log")
        os.close(fd)
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (_KILN_ROOT, env.get("PYTHONPATH")) if p)
        try:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", module, str(child_reads), str(child_writes)],
                    pass_fds=(child_reads, child_writes), stdin=subprocess.DEVNULL,
                    stdout=log, stderr=log, env=env, start_new_session=True)
        except OSError:
            for fd in (parent_reads, parent_writes):
                os.close(fd)
            Path(self.log).unlink(missing_ok=True)
            raise
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self.outbox = Connection(parent_writes, readable=False)
        self.inbox = Connection(parent_reads, writable=False)
        with contextlib.suppress(OSError):  # died at once: seen as EOF while starting
            self.outbox.send({"sys_path": [p for p in sys.path if isinstance(p, str)]})
        self.ready = False
        self.deadline = time.monotonic() + STARTUP_TIMEOUT
        self.job: tuple[int, int] | None = None  # (job index, job id) in flight
        self.started_at = 0.0
        self.timeout = 0.0
        self.log_offset = 0

    def submit(self, index: int, job_id: int, job, timeout: float) -> None:
        self.log_offset = os.path.getsize(self.log)
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        self.outbox.send({**job.message(), "id": job_id, "env": env})
        self.job = (index, job_id)
        self.started_at = time.monotonic()
        self.timeout = timeout
        self.deadline = self.started_at + timeout

    def stderr_tail(self, lines: int = 3) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        kept = [s.strip() for s in text.splitlines() if s.strip()][-lines:]
        return " | ".join(kept)[-600:]

    def death(self) -> str:
        """Why the process ended, e.g. 'killed by SIGABRT' (waits briefly for it to end)."""
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exited with status {code}"

    def stop(self, kill: bool = False, wait: bool = True) -> None:
        """End the worker; `wait=False` reaps it in a thread instead of here (a run
        worker's exit tears down its CUDA context: time the compile need not wait)."""
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                with contextlib.suppress(OSError):
                    self.outbox.send(None)
            if wait:
                self._reap()
            else:
                threading.Thread(target=self._reap, name="kiln-worker-exit", daemon=True).start()
        for conn in (self.outbox, self.inbox):
            conn.close()
        Path(self.log).unlink(missing_ok=True)

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WorkerPool:
    """Runs jobs (anything with a message() for `module`'s workers) on up to `size`
    reused workers; each job gets an Outcome. `what` names the work in failure reasons."""

    def __init__(self, size: int, module: str = COMPILE_WORKER, what: str = "compile"):
        self.size = max(1, size)
        self.module = module
        self.what = what
        self.workers: list[_Worker] = []
        self.workers_started = 0  # processes started over the pool's life
        self.jobs_sent = 0  # jobs handed to a worker over the pool's life
        self.start_error: str | None = None  # set once no worker could start
        self._start_failures = 0  # since a worker last became ready

    def run(self, jobs: list, timeout: float,
            want_more: Callable[[], bool] = lambda: True) -> Iterator[tuple[int, Outcome]]:
        """Yield (index into jobs, Outcome) as jobs finish, in completion order.

        Before handing out each job the pool asks `want_more()`; once it says no, jobs
        not yet started are dropped (those in flight still finish and are yielded).
        """
        queue = deque(enumerate(jobs))
        busy: dict[int, _Worker] = {}  # job id -> worker
        try:
            while True:
                if self.start_error is not None:
                    while queue:
                        yield queue.popleft()[0], Outcome(NO_WORKER, reason=self.start_error)
                if not want_more():
                    queue.clear()
                self._dispatch(queue, busy, timeout)
                self._grow(len(queue))
                if self.start_error is not None and queue:
                    continue
                # Wait for results, and for workers still starting only while jobs queue.
                waiting = [w for w in self.workers if w.job or (queue and not w.ready)]
                if not waiting:
                    return
                yield from self._wait(waiting, busy, jobs)
        finally:
            for w in busy.values():  # abandoned mid-run: a late reply must not be misread
                self._drop(w, kill=True)

    def prestart(self, count: int = 1) -> None:
        """Start workers now until `count` are up (at most the pool's size), so their
        start-up overlaps other work."""
        if self.start_error is None and len(self.workers) < min(count, self.size):
            self._grow(min(count, self.size))

    def _dispatch(self, queue, busy, timeout) -> None:
        for w in self.workers:
            if not queue:
                return
            if w.ready and w.job is None:
                index, job = queue.popleft()
                self.jobs_sent += 1
                try:
                    w.submit(index, self.jobs_sent, job, timeout)
                except OSError:  # died while idle: not this job's fault; retry elsewhere
                    queue.appendleft((index, job))
                    self._drop(w, kill=True)
                    continue
                busy[self.jobs_sent] = w

    def _grow(self, queued: int) -> None:
        if self._start_failures and self.workers:
            return  # a start failed: start no more until one of those starting is ready
        idle_or_starting = sum(1 for w in self.workers if not w.job)
        want = min(self.size - len(self.workers), queued - idle_or_starting)
        for _ in range(max(0, want)):
            try:
                self.workers.append(_Worker(self.module))
            except OSError as e:
                self.start_error = f"could not start a {self.what} worker: {e}"
                return
            self.workers_started += 1

    def _wait(self, waiting: list[_Worker], busy, jobs) -> Iterator[tuple[int, Outcome]]:
        now = time.monotonic()
        nearest = min(w.deadline for w in waiting)
        readable = wait([w.inbox for w in waiting], timeout=max(0.0, nearest - now))
        now = time.monotonic()
        for w in waiting:
            if w.inbox in readable:
                yield from self._receive(w, busy)
            elif now >= w.deadline:
                if w.job is None:
                    self._start_failed(w, f"worker did not start in {STARTUP_TIMEOUT:.0f} s")
                    continue
                index, job_id = w.job
                busy.pop(job_id, None)
                self._drop(w, kill=True)
                yield index, Outcome(HANG, reason=f"{self.what} did not finish within its "
                                     f"{w.timeout:g} s limit; worker killed",
                                     seconds=now - w.started_at)

    def _receive(self, w: _Worker, busy) -> Iterator[tuple[int, Outcome]]:
        try:
            msg = w.inbox.recv()
        except (EOFError, OSError):
            msg = None
        if msg is None:  # the process died
            tail = w.stderr_tail()
            if w.job is None:
                self._start_failed(w, f"worker {w.death()} while starting: {tail}")
                return
            index, job_id = w.job
            busy.pop(job_id, None)
            seconds = time.monotonic() - w.started_at
            why = f"{self.what} worker process {w.death()}" + (f": {tail}" if tail else "")
            self._drop(w, kill=True)
            yield index, Outcome(CRASH, reason=why, seconds=seconds)
            return
        if msg.get("status") == "ready":
            w.ready = True
            self._start_failures = 0
            return
        index, job_id = w.job
        busy.pop(job_id, None)
        w.job = None
        seconds = time.monotonic() - w.started_at
        if msg.get("id") != job_id:  # cannot happen unless the protocol broke: be safe
            self._drop(w, kill=True)
            yield index, Outcome(ERROR, reason=f"worker answered job {msg.get('id')}, "
                                 f"not {job_id}", seconds=seconds)
            return
        if msg.get("retire"):  # its state is lost (a faulted CUDA context): replace it
            self._drop(w)
        yield index, Outcome(msg["status"], msg.get("binary"), msg.get("reason", ""), seconds,
                             msg.get("result"))

    def _start_failed(self, w: _Worker, why: str) -> None:
        """A worker died or stalled before it was ready: a broken environment, not a config.

        No replacement starts until another worker proves the environment works; when
        none is left the pool gives up for good (start_error): every later job fails
        at once with NO_WORKER instead of each paying for another start.
        """
        self._drop(w, kill=True)
        self._start_failures += 1
        if not self.workers:
            self.start_error = why

    def _drop(self, w: _Worker, kill: bool = False, wait: bool = True) -> None:
        if w in self.workers:
            self.workers.remove(w)
        w.stop(kill=kill, wait=wait)

    def close(self, wait: bool = True) -> None:
        for w in list(self.workers):
            self._drop(w, kill=w.job is not None or not w.ready, wait=wait)


_pool: WorkerPool | None = None


def default_size() -> int:
    """A worker per core this process may use, but one: compiles are CPU-bound, and a
    model's kernels are compiled all at once (Tuner.precompile) while the parent waits."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return max(1, cores - 1)


def get_pool(size: int | None = None) -> WorkerPool:
    """The process's pool (created on first use, stopped at exit)."""
    global _pool
    if _pool is None:
        _pool = WorkerPool(size or default_size())
        atexit.register(shutdown)
    elif size and size != _pool.size:
        _pool.size = max(1, size)
        for w in [w for w in _pool.workers if w.job is None][: len(_pool.workers) - _pool.size]:
            _pool._drop(w)
    return _pool


_run_pool: WorkerPool | None = None


def get_run_pool() -> WorkerPool:
    """The process's run worker (one: candidates timed side by side on one GPU would
    slow each other), started on first use and kept for the rest of the compile
    (select_kernels stops it when every region has its kernel)."""
    global _run_pool
    if _run_pool is None:
        _run_pool = WorkerPool(1, RUN_WORKER, "run")
        atexit.register(shutdown)
    return _run_pool


_run_worker_holds = 0  # open run_worker_kept() blocks


def stop_run_worker() -> None:
    """Stop the run worker, freeing its CUDA context (and the GPU memory it holds) for the
    model that was just compiled; the next timed tuning starts another. Inside
    run_worker_kept() the stop waits for the outermost block's end."""
    global _run_pool
    if _run_pool is not None and not _run_worker_holds:
        _run_pool.close(wait=False)  # its memory is freed as it exits
        _run_pool = None


@contextlib.contextmanager
def run_worker_kept() -> Iterator[None]:
    """Compiles inside share one run worker, stopped when the outermost block ends.

    Why: select_kernels stops the worker when its plan is done, and the next plan's first
    timing waited for a fresh one (torch, Triton and a CUDA context: ~8 s on an H200
    machine). A kiln.compile with a narrow version runs select_kernels twice, and
    kiln.models compiles two modules: an 8B LLM's cold compile paid that wait two or
    three times."""
    global _run_worker_holds
    _run_worker_holds += 1
    try:
        yield
    finally:
        _run_worker_holds -= 1
        stop_run_worker()


def workers_started() -> int:
    """Worker processes the process's pools have started so far."""
    return sum(p.workers_started for p in (_pool, _run_pool) if p is not None)


def shutdown() -> None:
    """Stop every worker (at exit, or to free the processes early)."""
    global _pool, _run_pool
    for pool in (_pool, _run_pool):
        if pool is not None:
            pool.close()
    _pool = _run_pool = None
