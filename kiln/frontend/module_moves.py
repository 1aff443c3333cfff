"""A forward that moves one of its own modules to the dtype or device it already has.

SwitchTransformers' and NLLB-MoE's routers run `self.classifier =
self.classifier.to(self.dtype)` in forward: a no-op eagerly, but under torch.export
`Module.to` swaps each parameter for a converted copy, which fails on export's wrapped
parameters ("_apply(): Couldn't swap Linear.weight"), so the model could not be
captured. While kiln exports, a move that would change nothing returns the module
untouched; one that changes something still runs (and its error says to move first).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def noop_module_moves():
    """Inside: `Module.to(...)` that changes no parameter or buffer returns the module."""
    original = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is None and _already(self, device, dtype):
            return self
        return original(self, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def _already(module: torch.nn.Module, device, dtype) -> bool:
    """Whether every tensor of `module` has `device` and (floating or complex) `dtype`."""
    if device is not None and device.index is None and device.type == "cuda" \
            and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    for t in (*module.parameters(), *module.buffers()):
        if device is not None and t.device != device:
            return False
        if dtype is not None and (t.is_floating_point() or t.is_complex()) and t.dtype != dtype:
            return False
    return True
