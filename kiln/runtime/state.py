"""A compiled module's weights: the tensors its plan reads, on the target's device."""

from __future__ import annotations

import torch

from kiln.errors import ArgumentError
from kiln.runtime.program import Program
from kiln.target import Target


def device_present(target: Target) -> bool:
    """Can this process run on `target`? (A GPU target needs a GPU torch can see.)"""
    return target.torch_device != "cuda" or torch.cuda.is_available()


def state_for_target(program: Program, named: dict[str, torch.Tensor],
                     target: Target) -> dict[str, torch.Tensor]:
    """The parameters, buffers and constants `program` (and its narrow version) reads
    (by state-dict name, from `named`), on the target's device.

    On the model's own device they are shared, not copied (as torch.compile does): an
    8B model must not need two copies, and buffer updates (the KV cache) are the
    model's own. Compiling for a GPU on a machine without one (compile-only) leaves
    them where they are.
    """
    device = torch.device(target.torch_device if device_present(target) else "cpu")
    state = {}
    for v in (v for p in program.versions() for v in p.plan.values.values()):
        if v.target is None or v.target in state:
            continue
        t = named.get(v.target)
        if t is None:
            raise ArgumentError(f"the compiled plan reads {v.target}, which the model lacks")
        t = t.detach()
        keep = t.device.type in (device.type, "meta")  # meta: a plan built for its shapes
        state[v.target] = t if keep else t.to(device)
    return state
