"""Joining the ranks of a multi-device plan: the process group and kiln's groups.

kiln adds no launcher: torchrun (or kiln's spawner for one machine, or the user's own
init_process_group) starts the processes and sets RANK / WORLD_SIZE / MASTER_ADDR;
this module joins that world, makes the tensor-parallel groups (consecutive ranks)
and pipeline groups (every tp-th rank) the same way on every rank, as torch requires,
and binds them to the logical names the plan's collectives use. A timeout
(KILN_DIST_TIMEOUT) turns a dead peer into an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from kiln.errors import DistributedError
from kiln.ops.collectives import bind_group
from kiln.settings import dist_timeout_s

# (tp, pp, the default group) -> {"tp": group, "pp": group, "world": group}: each plan's
# groups, made once; the plan whose groups the collectives use now is _bound
_plans: dict[tuple, dict[str, object]] = {}
_bound: tuple | None = None


def _launched() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def local_device(rank: int, device_map: dict | None) -> int:
    """This rank's GPU: device_map's choice, else torchrun's LOCAL_RANK (per node)."""
    if device_map and rank in device_map:
        return int(device_map[rank])
    return int(os.environ.get("LOCAL_RANK", rank))


def join_world(tp: int, pp: int, device_type: str = "cpu",
               device_map: dict | None = None) -> bool:
    """Join (or start, from torchrun's environment) the process group of a tp x pp plan
    and bind "tp", "pp" and "world". False when there is no world to join (a plan made
    compile-only in one process); its module then cannot run. On GPUs, the rank's own
    device becomes the current one before anything is allocated on it."""
    if device_type == "cuda" and torch.cuda.is_available() and (
            dist.is_initialized() or _launched()):
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
        torch.cuda.set_device(local_device(rank, device_map))
    if not dist.is_initialized():
        if not _launched():
            return False
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=dist_timeout_s()))
    world = dist.get_world_size()
    if world != tp * pp:
        raise DistributedError(
            f"the plan has tp={tp} x pp={pp} = {tp * pp} ranks, but {world} processes joined",
            hint=f"launch exactly {tp * pp} processes: torchrun --nproc-per-node {tp * pp}")
    key = (tp, pp, dist.group.WORLD)
    if key not in _plans:  # every rank makes every group, in the same order
        rank, groups = dist.get_rank(), {"world": dist.group.WORLD}
        for p in range(pp):
            group = dist.new_group(list(range(p * tp, (p + 1) * tp)))
            if rank // tp == p:
                groups["tp"] = group
        for t in range(tp):
            group = dist.new_group(list(range(t, tp * pp, tp)))
            if rank % tp == t:
                groups["pp"] = group
        _plans[key] = groups
    use_groups(tp, pp)
    return True


def use_groups(tp: int, pp: int) -> None:
    """Bind "tp", "pp" and "world" to the groups of the tp x pp plan (made by join_world):
    a process holding modules of two plans (TP4 and PP4 of one world of 4) runs each
    module's collectives on its own plan's groups, not on the last plan joined."""
    global _bound
    key = (tp, pp, dist.group.WORLD) if dist.is_initialized() else None
    if key == _bound or key not in _plans:
        return
    for name, group in _plans[key].items():
        bind_group(name, group)
    _bound = key


def _peer_failed(op: str, peer: int, error: Exception) -> DistributedError:
    return DistributedError(
        f"{op} with rank {peer} failed: it died, or did not get there within the timeout "
        f"({error})",
        hint="look for the first error in the other ranks' output; KILN_DIST_TIMEOUT sets "
        "the timeout in seconds")


def post_send(t: torch.Tensor, dst: int, tag: int):
    """Start sending `t` to world rank `dst` under `tag`; the caller waits (wait_all)."""
    try:
        return dist.isend(t, dst, tag=tag)
    except RuntimeError as e:
        raise _peer_failed("sending activations", dst, e) from e


def post_recv(t: torch.Tensor, src: int, tag: int):
    """Start receiving into `t` from world rank `src` under `tag`."""
    try:
        return dist.irecv(t, src, tag=tag)
    except RuntimeError as e:
        raise _peer_failed("receiving activations", src, e) from e


def wait_all(works: list, what: str, peers: list[int]) -> None:
    """Wait for posted sends or receives; a dead peer is a DistributedError naming it."""
    for w, peer in zip(works, peers):
        try:
            w.wait()
        except RuntimeError as e:
            raise _peer_failed(what, peer, e) from e


def agree(error: Exception | None, what: str) -> None:
    """Every rank raises when any rank's `error` is set: a choice one rank refuses (a
    call's micro-batches) must not leave the others waiting for it until the timeout."""
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else str(error))
    if error is not None:
        raise error
    for rank, message in enumerate(errors):
        if message is not None:
            raise DistributedError(f"rank {rank} refused {what}: {message}",
                                   hint="every rank must accept it; fix what rank "
                                   f"{rank} says")


def broadcast_tensors(tensors: list, src: int, group_name: str = "pp") -> None:
    """Every rank of `group_name` gets world rank `src`'s tensors (in place)."""
    from kiln.ops.collectives import bound_group

    try:
        for t in tensors:
            dist.broadcast(t, src, group=bound_group(group_name))
    except RuntimeError as e:
        raise _peer_failed("broadcasting the outputs", src, e) from e
