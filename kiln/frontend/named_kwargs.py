"""Keyword arguments that land in a model's **kwargs, named for torch.export.

Why: torch.export cannot take dynamic_shapes for a model whose forward gathers keyword
arguments in **kwargs: a dict by argument name must have a "kwargs" entry, and that
form fails inside torch (AssertionError "Must provide a tree_name when there might be a
mismatch", pytorch/pytorch#150022, #164313). Many transformers models take use_cache or
return_dict that way (GraniteMoe's forward), so `kiln.compile(model, (), {"input_ids":
ids, "use_cache": False}, dynamic_shapes={"input_ids": {1: seq}, "use_cache": None})`
failed. While exporting, the model's forward here has a signature that names each such
argument (keyword-only): torch.export binds them like any other, the call is the same,
and the parameter names and the compiled module's call are unchanged. A dynamic_shapes
dict written torch's way ({"kwargs": {...}}) is flattened to those names.
"""

from __future__ import annotations

import contextlib
import inspect

import torch

_NO_FORWARD = object()


def _extra_names(sig: inspect.Signature, kwargs: dict) -> list[str] | None:
    """The keyword arguments that would land in the forward's **kwargs, or None when
    there are none or the forward also takes *args (then nothing is renamed)."""
    kinds = {p.kind for p in sig.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD not in kinds or inspect.Parameter.VAR_POSITIONAL in kinds:
        return None
    named = {n for n, p in sig.parameters.items() if p.kind != inspect.Parameter.VAR_KEYWORD}
    extra = [k for k in kwargs if k not in named]
    return extra or None


@contextlib.contextmanager
def kwargs_by_name(model: torch.nn.Module, kwargs: dict, dynamic_shapes):
    """Inside: `model.forward` names the keyword arguments its **kwargs would take; yields
    `dynamic_shapes` to pass torch.export (a "kwargs" sub-dict flattened into them)."""
    sig = inspect.signature(model.forward)
    extra = _extra_names(sig, kwargs)
    if extra is None:
        yield dynamic_shapes
        return
    var_kw = next(n for n, p in sig.parameters.items() if p.kind == inspect.Parameter.VAR_KEYWORD)
    params = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    params += [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in extra]
    original = model.forward  # bound: the class's, or one the instance was given

    def forward(*args, **kw):
        return original(*args, **kw)

    forward.__signature__ = sig.replace(parameters=params)
    before = model.__dict__.get("forward", _NO_FORWARD)
    model.__dict__["forward"] = forward
    try:
        yield _flattened(dynamic_shapes, var_kw, extra)
    finally:
        if before is _NO_FORWARD:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = before


def _flattened(dynamic_shapes, var_kw: str, extra: list[str]):
    """A dict whose `var_kw` entry (torch's way of writing **kwargs) holds the extra
    arguments' specs, as top-level entries; anything else as it is."""
    if not isinstance(dynamic_shapes, dict) or var_kw in extra:
        return dynamic_shapes
    inner = dynamic_shapes.get(var_kw)
    if not isinstance(inner, dict):
        return dynamic_shapes
    out = {k: v for k, v in dynamic_shapes.items() if k != var_kw}
    out.update(inner)
    return out
