"""A model's identity before export, for models built only from kiln's and torch's modules.

Why: the compile cache is keyed after torch.export (fingerprint.py), so even a hit pays
for export: ~18 s of a Llama-3-8B's warm compile for generation, over issue 10's 15 s.
For a model of arbitrary code that is the only sound key (patched functions, environment
variables, configs made on the fly decide its program). A model whose every module is a
kiln.models class or a torch.nn one is different: its code is kiln's (the cache key
already holds a digest of kiln's source) or torch's (its version), so what its program
is made of can be read from the module tree itself.

The identity covers every module's path, class and plain attributes (configs, sizes,
flags, `training`) and every parameter's and buffer's name, shape, strides, dtype,
device, kind and which ones share memory. There is none (None: the compile exports as
always) when a module's class lives elsewhere, any forward hook is set (on a module or
globally), a module's method is replaced on the instance, or an attribute is something
other than plain data (a function, an object of an unknown class). Not seen: a function
of torch or kiln replaced at run time (`torch.nn.functional.silu = ...`), which no source
digest or version shows; KILN_COMPILE_CACHE=0 is the way out then. Only entries a compile
keyed after export has already written are found by it (compile_cache.alias): a miss
costs nothing but the walk over the tree.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib

import torch
from torch.nn.modules import module as nn_module

from kiln.frontend.fingerprint import tensor_identity, tied_memory

_TRUSTED = ("kiln.", "torch.nn.")
# Module.__dict__ entries that are the module's machinery, read through the API instead
_MACHINERY = {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"}
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks",
                 "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
                 "_global_module_registration_hooks", "_global_buffer_registration_hooks",
                 "_global_parameter_registration_hooks")


class _Untrusted(Exception):
    pass


def module_identity(model: torch.nn.Module) -> str | None:
    """A digest of what `model`'s program is made of, or None where it cannot be read
    from the module tree (see the module docstring)."""
    if any(getattr(nn_module, name, None) for name in _GLOBAL_HOOKS):
        return None
    h = hashlib.sha256()

    def put(*parts) -> None:
        h.update(repr(parts).encode())
        h.update(b"\0")

    try:
        for path, m in model.named_modules(remove_duplicate=False):
            cls = type(m)
            if not cls.__module__.startswith(_TRUSTED):
                return None
            put("module", path, cls.__module__, cls.__qualname__)
            for name, value in sorted(vars(m).items()):
                if name in _MACHINERY:
                    continue
                if "hook" in name:
                    if value:  # a forward / state-dict / load hook on this module
                        return None
                    continue
                put("attr", name, _plain(value))
            put("persistent-off", sorted(m._non_persistent_buffers_set))
    except _Untrusted:
        return None
    groups: dict[tuple, int] = {}
    for kind, items in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            put(kind, name, tensor_identity(t), groups.setdefault(tied_memory(t), len(groups)))
    put("torch", torch.get_default_dtype(), torch.is_grad_enabled())
    return h.hexdigest()


def module_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s parameters and buffers by the names a captured program gives them."""
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    return state


def _plain(value):
    """`value` as plain data for the digest; _Untrusted for anything else."""
    if value is None or isinstance(value, bool | int | float | str | complex | torch.dtype
                                   | torch.device | torch.Size | enum.Enum):
        return repr(value)
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
        return (type(value).__name__, tuple(_plain(v) for v in items))
    if isinstance(value, dict):
        return ("dict", tuple((repr(k), _plain(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):  # a plain tensor attribute: export lifts it
        return ("tensor", tensor_identity(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and \
            type(value).__module__.startswith(_TRUSTED):
        return (type(value).__qualname__,
                tuple((f.name, _plain(getattr(value, f.name)))
                      for f in dataclasses.fields(value)))
    raise _Untrusted(type(value).__qualname__)
