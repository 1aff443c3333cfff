"""`table[t]` with a 0-d integer tensor `t`, captured as the index op it is.

torch 2.13 captures it as `.item()` and a select, which scalar_index.py rewrites to
`aten.index`; torch 2.11 (the GPU image's) fails inside the select, guarding on the
unbacked item's range, and export raised a data-dependent error. After such an error
export runs again under this mode (export.py), which turns such a subscript (0-d
integer tensors and whole-dim slices only) into `aten.index` with the tensors as
indices before torch's own subscript runs: eager's meaning (negative positions wrap,
one past the end is an IndexError), no value needed at compile time. Other subscripts
are left to torch. Only on a retry: under the mode every torch call passes through
its frame, which torch then names as a guard's cause instead of the model's line.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8)  # uint8 is a mask


def _position(item) -> bool:
    return isinstance(item, torch.Tensor) and item.dim() == 0 and item.dtype in _INDEX_DTYPES


def _whole(item) -> bool:
    return isinstance(item, slice) and item == slice(None)


class TensorPositions(TorchFunctionMode):
    """Rewrites `x[t]`, `x[:, t]`, `x[t, s]` (t, s 0-d integer tensors) to aten.index."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            x, index = args
            items = index if isinstance(index, tuple) else (index,)
            if any(_position(i) for i in items) and all(
                    _position(i) or _whole(i) for i in items) and len(items) <= x.dim():
                return torch.ops.aten.index.Tensor(x, [i if _position(i) else None
                                                       for i in items])
        return func(*args, **(kwargs or {}))
