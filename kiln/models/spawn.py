"""A multi-device LLM outside torchrun: kiln starts the other ranks on this machine.

Under torchrun every rank calls `kiln.models.load` itself. Anywhere else (a notebook,
`kiln generate -tp 2`) this process becomes rank 0 and spawns ranks 1..N-1, each of
which loads the same model and then waits for calls: rank 0's LLM sends every call
(generate, forward) to them before making it, so all ranks run it in step, as SPMD
needs. Several machines are torchrun's job (its rendezvous); kiln adds no launcher.
"""

from __future__ import annotations

import atexit
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CALLS = ("generate", "forward")  # what rank 0 forwards to the others
_open: list = []  # this process's SpawnedLLM still running its ranks (at most one)


def open_world():
    """The multi-device LLM whose ranks this process spawned and has not closed, if any.
    Its ranks wait on its calls: a second load here would join their world as a rank
    and wait for them forever."""
    return _open[0] if _open else None


def under_launcher() -> bool:
    """Is this process already a rank (torchrun's environment, or a process group)?"""
    return "RANK" in os.environ or (dist.is_available() and dist.is_initialized())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _rank_env(rank: int, world: int, port: int) -> dict:
    """Set torchrun's variables for `rank`; returns what they were, to put back."""
    before = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    return before


def _leave_world(env_before: dict) -> None:
    """Rank 0 is this process: once its ranks are gone, it is not a rank any more (a
    later kiln.compile with parallel= must not find a dead world in its environment)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in env_before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _worker(rank: int, world: int, port: int, load_kwargs: dict) -> None:
    from kiln.models import load

    _rank_env(rank, world, port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    llm = load(**load_kwargs)
    control = dist.new_group(backend="gloo")
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0, group=control)
        if msg[0] is None:
            break
        method, args, kwargs = msg[0]
        getattr(llm, method)(*args, **kwargs)
    dist.destroy_process_group()


class SpawnedLLM:
    """Rank 0's LLM of a plan whose other ranks kiln spawned: use it like the LLM."""

    def __init__(self, llm, control, procs, env_before: dict):
        self._llm, self._control, self._procs = llm, control, procs
        self._env_before = env_before
        _open.append(self)
        atexit.register(self.close)

    def __getattr__(self, name):
        return getattr(self._llm, name)

    def _send(self, msg) -> None:
        dist.broadcast_object_list([msg], src=0, group=self._control)

    def _call(self, method: str, args, kwargs):
        # callbacks (on_text) stay here: the other ranks only keep in step
        sent = {k: v for k, v in kwargs.items() if not callable(v)}
        self._send((method, args, sent))
        return getattr(self._llm, method)(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self._call("generate", args, kwargs)

    def forward(self, *args, **kwargs):
        return self._call("forward", args, kwargs)

    def close(self) -> None:
        """Stop the other ranks (also at exit)."""
        if self._procs is None:
            return
        procs, self._procs = self._procs, None
        if self in _open:
            _open.remove(self)
        if dist.is_initialized():
            self._send(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        _leave_world(self._env_before)


def spawn_llm(load_kwargs: dict, world: int) -> SpawnedLLM:
    """Start ranks 1..world-1, load as rank 0, and return rank 0's LLM."""
    from kiln.models import load

    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, port, load_kwargs), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    env_before = _rank_env(0, world, port)
    try:
        llm = load(**load_kwargs)
        control = dist.new_group(backend="gloo")
    except BaseException:
        for p in procs:
            p.kill()
        _leave_world(env_before)
        raise
    return SpawnedLLM(llm, control, procs, env_before)
