"""Collectives as graph ops: `kiln::all_reduce` and `kiln::all_gather`.

Tensor parallelism inserts them into a rank's graph. They name a LOGICAL group
("tp"), bound to a real ProcessGroup when the module runs (`bind_group`), so a saved
plan does not depend on the process-group names of the run that compiled it. They
run through torch.distributed's functional collectives, which work on gloo (CPU) and
NCCL and can be captured in CUDA graphs. Shapes need only the group's size
(`declare_group_size`), so a plan is made without any process group (compile-only).
"""

from __future__ import annotations

import torch

from kiln.errors import DistributedError

_sizes: dict[str, int] = {}
_groups: dict[str, object] = {}


def declare_group_size(name: str, size: int) -> None:
    """The number of ranks in group `name`, for shapes while compiling."""
    _sizes[name] = size


def bind_group(name: str, group) -> None:
    """Run the collectives on group `name` over the torch.distributed ProcessGroup."""
    import torch.distributed as dist

    _groups[name] = group
    _sizes[name] = dist.get_world_size(group)


def bound_group(name: str):
    group = _groups.get(name)
    if group is None:
        raise DistributedError(
            f"this module runs collectives on the {name!r} group, but no process group "
            "is bound to it in this process",
            hint="run every rank under torchrun (or kiln's launcher) and compile or load "
            "the module there with parallel={'tp': T, 'pp': P}")
    return group


def group_size(name: str) -> int:
    if name not in _sizes:
        raise DistributedError(f"the size of group {name!r} is unknown",
                               hint="compile with parallel={'tp': T, 'pp': P}")
    return _sizes[name]


def _functional():
    return torch.ops._c10d_functional


def _failed(op: str, group: str, error: Exception) -> DistributedError:
    return DistributedError(
        f"{op} on the {group!r} group failed: a peer rank died, or did not reach this "
        f"collective within the timeout ({error})",
        hint="look for the first error in the other ranks' output; KILN_DIST_TIMEOUT "
        "sets the timeout in seconds")


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of `x` over the ranks of `group`."""
    pg = bound_group(group)
    try:
        out = _functional().all_reduce(x.contiguous(), "sum", pg.group_name)
        return _functional().wait_tensor(out)
    except RuntimeError as e:
        raise _failed("all_reduce", group, e) from e


@all_reduce.register_fake
def _(x, group):
    return torch.empty_like(x)


@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim`, in rank order within `group`."""
    pg = bound_group(group)
    n = group_size(group)
    moved = x.movedim(dim, 0).contiguous()
    try:
        out = _functional().wait_tensor(
            _functional().all_gather_into_tensor(moved, n, pg.group_name))
    except RuntimeError as e:
        raise _failed("all_gather", group, e) from e
    return out.movedim(0, dim).contiguous()


@all_gather.register_fake
def _(x, dim, group):
    shape = list(x.shape)
    shape[dim] *= group_size(group)
    return x.new_empty(shape)
