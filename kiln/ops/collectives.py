"""Temporary stand-in (lead's testing) for kiln/ops/collectives.py."""
import torch
import torch.distributed as dist
_SIZES = {}
_GROUPS = {}
def declare_group_size(name, size): _SIZES[name] = size
def bind_group(name, pg): _GROUPS[name] = pg; _SIZES[name] = dist.get_world_size(pg)
@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    y = x.clone(); dist.all_reduce(y, group=_GROUPS[group]); return y
@all_reduce.register_fake
def _(x, group): return torch.empty_like(x)
@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    g = _GROUPS[group]; outs = [torch.empty_like(x) for _ in range(dist.get_world_size(g))]
    dist.all_gather(outs, x.contiguous(), group=g); return torch.cat(outs, dim)
@all_gather.register_fake
def _(x, dim, group):
    s = list(x.shape); s[dim] *= _SIZES[group]; return x.new_empty(s)
