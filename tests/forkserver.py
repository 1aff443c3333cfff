"""Test worker processes forked from one forkserver that has imported torch and kiln.

A spawned process spends seconds of CI's two cores importing torch, kiln and what torch
imports on a first export; forked from a server that has imported them (and run
nothing), a worker starts in milliseconds and still starts fresh. The server keeps the
environment and working directory of its own start, so a worker is handed the caller's
(`caller()`) and takes them on (`enter`) before it does anything.
"""

from __future__ import annotations

import multiprocessing
import os

# imported once by the server (a missing one is skipped): kiln, what torch imports on a
# first export (about a second of a core per worker), and the test modules workers run
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._functorch.aot_autograd",
           "torch._functorch.partitioners", "torch._inductor", "torch.export._trace",
           "networkx", "kiln", "kiln.models", "kiln.models.hf", "tests.forkserver",
           "tests.parallel.spmd", "tests.fuzz.oracle", "tests.fuzz.generate"]


def context():
    """The forkserver start method, its server importing PRELOAD when it starts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def caller(env: dict | None = None) -> tuple[dict, str]:
    """This process's environment (updated with `env`) and working directory."""
    return {**os.environ, **(env or {})}, os.getcwd()


def enter(where: tuple[dict, str]) -> None:
    """In a worker: take on the environment and working directory `caller` gave."""
    env, cwd = where
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
