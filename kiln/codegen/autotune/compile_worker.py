"""The compile worker: `python -m kiln.codegen.autotune.compile_worker <read-fd> <write-fd>`.

Runs in its own process so that whatever a compile does to it (a C++ abort in Triton,
a segfault, an endless loop) cannot reach the compile that asked. It imports torch and
Triton once, says "ready", then serves jobs until its input closes:

    job   {"id", "fn": "module:function", "spec": KernelSpec JSON, "config": Config JSON,
           "target": Target, "env": the parent's KILN_* / TRITON_* variables}
    reply {"id", "status": "ok", "binary": Binary}
        | {"id", "status": "error" | "over_limit", "reason": "ExcType: message"}

Messages travel on their own pipes (not stdout), so prints and compiler warnings
cannot corrupt them; stdout and stderr go to a log the parent reads after a crash.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from multiprocessing.connection import Connection

FORWARDED_ENV = ("KILN_", "TRITON_")


def resolve(path: str):
    """The function named by 'package.module:function'."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _apply_env(env: dict[str, str]) -> None:
    """Take the parent's KILN_/TRITON_ settings for this job (KILN_CACHE_DIR may change)."""
    for k in [k for k in os.environ if k.startswith(FORWARDED_ENV) and k not in env]:
        del os.environ[k]
    os.environ.update(env)


def _reason(e: BaseException) -> str:
    """`e` in one line: its first line (torch's CUDA errors name the cause there, "CUDA
    error: an illegal memory access was encountered", then three lines of advice) and
    its last two (a compiler's message ends with the failing line)."""
    text = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    kept = text[:1] + text[max(1, len(text) - 2):]
    head = " ".join(kept)[:500]
    return f"{type(e).__name__}: {head}" if head else type(e).__name__


def run_job(job: dict) -> dict:
    from triton.runtime.errors import OutOfResources

    from kiln.codegen.build.spec import Config, KernelSpec

    _apply_env(job["env"])
    try:
        fn = resolve(job["fn"])
        binary = fn(KernelSpec.from_json(job["spec"]), Config.from_json(job["config"]),
                    job["target"])
    except OutOfResources as e:
        return {"id": job["id"], "status": "over_limit", "reason": _reason(e)}
    except Exception as e:  # any compiler error is this config's failure, reported back
        return {"id": job["id"], "status": "error", "reason": _reason(e)}
    binary._kernel = None  # never ship a loaded kernel: the parent loads its own
    return {"id": job["id"], "status": "ok", "binary": binary}


def _no_core_dumps() -> None:
    """A crashing compile is expected here; it must not fill the disk with core files."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass


def _exit_with_parent() -> None:
    """Leave when the parent is gone (even when it was killed and could not stop us)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="kiln-parent-watch").start()


def serve(argv: list[str], handle, warm_up) -> None:
    """A worker's life: take the parent's sys.path, `warm_up()` (the slow imports),
    say "ready", then answer each job with `handle(job)` until the input closes. A reply
    with "retire" set is this worker's last (its state is lost): it exits after it."""
    inbox = Connection(int(argv[1]), writable=False)
    outbox = Connection(int(argv[2]), readable=False)
    init = inbox.recv()
    sys.path[:0] = [p for p in init["sys_path"] if p not in sys.path]
    _no_core_dumps()
    _exit_with_parent()
    warm_up()
    outbox.send({"status": "ready", "pid": os.getpid()})
    while True:
        try:
            job = inbox.recv()
        except EOFError:
            return
        if job is None:
            return
        reply = handle(job)
        try:
            outbox.send(reply)
        except Exception as e:  # the result would not pickle: report that instead
            outbox.send({"id": job["id"], "status": "error",
                         "reason": f"result could not be sent back: {_reason(e)}"})
        if reply.get("retire"):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _warm_up() -> None:
    import kiln.codegen.build.compiler  # noqa: F401 - torch + triton: the slow imports


def main(argv: list[str]) -> None:
    serve(argv, run_job, _warm_up)


if __name__ == "__main__":
    main(sys.argv)
