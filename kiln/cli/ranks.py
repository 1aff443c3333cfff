"""A command of a multi-device plan (`kiln run -tp 2`) outside torchrun: kiln starts
the other ranks on this machine, each running the same command line.

SPMD as torchrun runs it: every rank compiles (or loads) the same model and makes the
same calls; this process is rank 0 and prints, the others' stdout is dropped (their
errors still reach stderr). Under torchrun (or an initialised process group) nothing is
spawned: each process already is a rank. A rank that exits with an error ends the
command at once rather than leaving rank 0 waiting for it in a collective.
"""

from __future__ import annotations

import os
import sys
import threading

import torch.multiprocessing as mp

from kiln.errors import KilnError


def _rank_main(rank: int, world: int, port: int, argv: list[str]) -> None:
    import torch.distributed as dist

    from kiln.cli import main
    from kiln.models.spawn import _rank_env

    _rank_env(rank, world, port)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - rank 0 prints for every rank
    try:
        code = main(argv)
    finally:
        # leave the world before the interpreter ends, as torch asks: a rank whose
        # group was left for interpreter shutdown to tear down once aborted at exit
        # ("terminate called without an active exception", not reproduced since),
        # failing a `kiln run` whose work had finished
        if dist.is_initialized():
            dist.destroy_process_group()
    raise SystemExit(code)


def _watch(procs, done: threading.Event) -> None:
    """End this process when another rank fails: it would wait for that rank until the
    collective's timeout."""
    while not done.is_set():
        for rank, p in enumerate(procs, start=1):
            if p.exitcode not in (None, 0):
                print(f"kiln: error: rank {rank} of {len(procs) + 1} exited with status "
                      f"{p.exitcode} (its error is above); stopping every rank",
                      file=sys.stderr, flush=True)
                for q in procs:
                    q.kill()
                os._exit(2)
        done.wait(0.2)


def plan_size(args) -> tuple[int, int]:
    """(-tp, -pp) of the command, checked."""
    sizes = (args.tensor_parallel_size, args.pipeline_parallel_size)
    for flag, n in zip(("--tensor-parallel-size", "--pipeline-parallel-size"), sizes):
        if n < 1:
            raise KilnError(f"{flag} must be at least 1, got {n}")
    return sizes


def run_as_ranks(fn, args, world: int) -> int:
    """fn(args) on every rank of a `world`-process plan: spawned here when this process
    is not a rank yet (it becomes rank 0), else this process's part alone."""
    from kiln.models.spawn import _free_port, _leave_world, _rank_env, under_launcher

    if world == 1 or under_launcher():
        if os.environ.get("RANK", "0") != "0":  # under torchrun: rank 0 prints for all
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
        return fn(args)
    port = _free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args.argv), daemon=True)
             for r in range(1, world)]
    for p in procs:
        p.start()
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(procs, done), daemon=True)
    watcher.start()
    env_before = _rank_env(0, world, port)
    try:
        code = fn(args)
    except BaseException:
        done.set()
        for p in procs:
            p.kill()
        raise
    finally:
        _leave_world(env_before)
    done.set()
    for p in procs:
        p.join(timeout=60)
    failed = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise KilnError(f"ranks {[r for r, _ in failed]} of {world} did not finish cleanly "
                        f"(exit statuses {[c for _, c in failed]})",
                        hint="look for their errors above")
    return code
