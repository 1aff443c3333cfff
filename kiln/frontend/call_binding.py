"""A call bound to the model's forward signature, for a LazyModule, as torch.compile binds it.

Why: a LazyModule keeps one compiled module per call signature, and a compiled module
takes the one call structure it was compiled from. `m(x, y)`, `m(x, y=y)` and
`m(x, y, scale=2.0)` (2.0 being scale's default) are one call of `forward(x, y,
scale=2.0)`: written in one canonical form they find one module, as they find one
torch.compile graph. The form: the parameters bound positionally up to the first one
not passed, the rest by keyword (inspect.BoundArguments.args / .kwargs), an argument
equal to its default left out (a default's object is never handed to torch.export: a
sentinel would not export). A call forward cannot take is an ArgumentError naming the
parameter, before anything compiles (torch.export would report it as the model's own
TypeError, raised inside inspect).
"""

from __future__ import annotations

import inspect

import torch

from kiln.errors import ArgumentError

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


class CallBinder:
    """Writes a call of `model` in its canonical form (`canonical`) and fits the
    LazyModule's dynamic_shapes to that form (`dynamic_shapes_for`)."""

    def __init__(self, model):
        fn = model.forward if isinstance(model, torch.nn.Module) else model
        self.model_name = type(model).__name__
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to bind to: calls pass as they are
            self.signature = None
        params = list(self.signature.parameters.values()) if self.signature else []
        # A call of just the leading parameters without defaults, positionally, is
        # canonical already: the common call skips binding.
        self.plain = None if self.signature is None else next(
            (i for i, p in enumerate(params) if p.kind not in _POSITIONAL
             or p.default is not p.empty), len(params))

    def canonical(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The call as (args, kwargs) in the canonical form; ArgumentError if forward
        cannot take it."""
        if self.plain is None or (not kwargs and len(args) == self.plain):
            return args, kwargs
        bound = self._bind(args, kwargs)
        params = self.signature.parameters
        # *args passed: a parameter before them must stay positional to keep their places
        keep_positional = any(params[n].kind is _P.VAR_POSITIONAL for n in bound.arguments)
        for name, value in list(bound.arguments.items()):
            p = params[name]
            if p.default is p.empty or p.kind is _P.POSITIONAL_ONLY or \
                    (keep_positional and p.kind is _P.POSITIONAL_OR_KEYWORD):
                continue
            if _is_default(value, p.default):
                del bound.arguments[name]
        return bound.args, bound.kwargs

    def dynamic_shapes_for(self, dynamic_shapes, args: tuple, kwargs: dict):
        """`dynamic_shapes` without the entries of parameters with defaults that the
        canonical call (args, kwargs) leaves out: torch.export wants a dict's keys to
        be the arguments passed, and whether a default was passed is no longer the
        caller's choice."""
        if self.signature is None or not isinstance(dynamic_shapes, dict):
            return dynamic_shapes
        passed = self._bind(args, kwargs).arguments
        params = self.signature.parameters
        return {k: v for k, v in dynamic_shapes.items()
                if k in passed or k not in params or params[k].default is params[k].empty}

    def _bind(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        try:
            return self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise self._refused(str(e), len(args)) from None

    def _refused(self, why: str, given: int) -> ArgumentError:
        forward = f"{self.model_name}.forward{self.signature}"
        if why == "too many positional arguments":
            names = [p.name for p in self.signature.parameters.values() if p.kind in _POSITIONAL]
            why = f"it takes {len(names)} positional arguments ({', '.join(names)}), got {given}"
        return ArgumentError(
            f"{forward} cannot take this call: {why}",
            where=f"a call of kiln.compile({self.model_name}) (no example args)",
            hint=f"call it with the arguments its forward takes: forward{self.signature}")


def _is_default(value, default) -> bool:
    """Is `value` the parameter's default (the object itself, or an equal plain value)?"""
    if value is default:
        return True
    if type(value) is not type(default) or isinstance(value, torch.Tensor):
        return False
    try:
        return bool(value == default)
    except Exception:  # an == that gives no bool (a container of tensors): not the default
        return False
