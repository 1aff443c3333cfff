"""Run a function on N CPU processes joined by gloo, the way torchrun would start them.

Each process gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) so kiln joins the world as it would under torchrun (torchrun itself, two
"nodes" of it: test_tp_runs.py). A rank's exception comes back to the test with its
traceback; a run past `timeout` is killed and fails.

Ranks are forked from a forkserver that imported torch and kiln once (tests/forkserver.py):
a rank starts in milliseconds, where a spawned one spent seconds of CI's two cores on
its imports. Each still starts fresh, with the test's environment and working
directory at the call.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch

from tests import forkserver


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, where, results):
    forkserver.enter(where)  # the test's environment, not the forkserver's from its start
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        # pickled here, by value: tensors sent as shared memory die with this process
        results.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - sent back to the test whatever it was
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Died:
    """What run_spmd returns for a rank that exited without a result."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def __repr__(self) -> str:
        return f"Died(exitcode={self.exitcode})"


def run_spmd(fn, world: int, *args, timeout: float = 120, env=None,
             may_die=()) -> list:
    """fn(rank, world, *args) on `world` processes; the per-rank results, in rank order.

    A rank in `may_die` that exits without a result gives Died(exitcode); any other
    failure, or a run past `timeout`, fails the test.
    """
    ctx = forkserver.context()
    results = ctx.Queue()
    port = free_port()
    where = forkserver.caller(env)
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, where, results))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in out]
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s")
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in out and not p.is_alive() and r in may_die:
                        out[r] = Died(p.exitcode)
                continue
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world)]
