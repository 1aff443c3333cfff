"""Compiling a model's candidates in a thread while the tuner times those already built.

Why: precompile compiled every candidate of every kernel in one worker-pool run, and only
then was each kernel timed, one after another: the 8B LLM's cold compile on an H200 (16
cores) spent 17.4 s building and then 32.5 s timing, the GPU idle during the first and
the compile workers during the second. Here the pool run goes on in a thread, its jobs
in the order the kernels are chosen, and choosing a kernel waits only for its own
candidates. The pool's workers are processes: the thread only hands out jobs and reads
replies. The compile workers and the timing share the CPU: on an H200 (16 cores) the
8B LLM's GPU timing took 39.6 s against 35.6 alone, and the whole cold compile 93 s
against 106 (builds 30 s, now behind the timing); kiln bench's prefill and decode with
the choices it made ran as fast. On by default; KILN_TUNE_OVERLAP=0 turns it off.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable

from kiln.codegen.autotune.worker_pool import Job, Outcome


def job_key(job: Job) -> tuple:
    return (job.spec.source_hash, job.config)


class BackgroundBuild:
    """Runs `run()` (yielding (index into jobs, Outcome) as jobs finish) in a thread,
    handing each to `record(job, outcome)`; `wait(key)` returns once that job is
    recorded, or the run ended without it (dropped, or the run failed: the caller then
    compiles it itself, after `join`)."""

    def __init__(self, jobs: list[Job], run: Callable[[], Iterable[tuple[int, Outcome]]],
                 record: Callable[[Job, Outcome], None]):
        self._ready = {job_key(j): threading.Event() for j in jobs}
        self._error: BaseException | None = None
        work = contextvars.copy_context()  # phases and progress record as the caller's
        self._thread = threading.Thread(target=work.run, args=(self._work, jobs, run, record),
                                        name="kiln-background-build", daemon=True)
        self._thread.start()

    def _work(self, jobs, run, record) -> None:
        try:
            for i, out in run():
                record(jobs[i], out)
                self._ready[job_key(jobs[i])].set()
        except BaseException as e:  # told to the caller at join
            self._error = e
        finally:
            for ready in self._ready.values():
                ready.set()

    def wait(self, key: tuple) -> None:
        ready = self._ready.get(key)
        if ready is not None:
            ready.wait()

    def join(self) -> None:
        """Wait for the whole run; raise what it raised, if anything."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
