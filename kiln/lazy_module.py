"""LazyModule: what kiln.compile(model) gives without example args, as torch.compile does.

kiln compiles ahead of time from example arguments, but users coming from torch.compile
call `kiln.compile(model)` and pass arguments later. A LazyModule compiles on its first
call from that call's own arguments, exactly as `kiln.compile(model, args, kwargs, ...)`
would, and keeps the module by call signature (pytree structure, each tensor's shape,
dtype and device, non-tensor values). A call is first written in one form whichever
way it is spelt (positional or keyword, a default passed or left out:
frontend/call_binding.py), so those spellings share a module. A call no kept module
accepts compiles another, with a KilnWarning saying what changed, up to
`max_modules`. kiln never makes a dim dynamic on its own (its dynamic dims are always
bounded), so the warning says how to declare one instead.
"""

from __future__ import annotations

import inspect
import warnings

import torch
import torch.utils._pytree as pytree

from kiln.errors import DeviceError, KilnWarning, LazyModuleError, RecompileLimitError
from kiln.frontend.call_binding import CallBinder

MAX_MODULES = 8  # as torch.compile's recompile limit (torch._dynamo.config)
_MAX_SIGNATURES = 256  # signatures remembered (sizes a bounded Dim accepts, each one)


class LazyModule:
    """Call it like the model; `modules` are the modules compiled so far. `save`,
    `explain` and attributes (`plan`, `cuda_graphs`, ...) are the compiled module's
    while there is exactly one."""

    def __init__(self, model, compile_fn, target, max_modules: int, compile_kw: dict):
        self._model = model
        self._compile = compile_fn  # compile_fn(model, args, kwargs, target=, **compile_kw)
        self._target = target  # None: each compile's from its call's tensors
        self.max_modules = max_modules
        self._kw = compile_kw
        self._compiled: list[tuple[object, list]] = []  # (module, its call: _described)
        self._by_signature: dict = {}
        self._names = _parameter_names(model)
        self._binder = CallBinder(model)

    @property
    def modules(self) -> tuple:
        """The compiled modules, one per call signature met, in the order compiled."""
        return tuple(m for m, _ in self._compiled)

    def __call__(self, *args, **kwargs):
        args, kwargs = self._binder.canonical(args, kwargs)
        key = _signature(args, kwargs)
        module = self._by_signature.get(key)
        if module is None:
            module = self._module_for(key, args, kwargs)
        return module(*args, **kwargs)

    def _module_for(self, key, args: tuple, kwargs: dict):
        """A kept module that accepts the call (a bounded Dim's other size), else a new one."""
        module = next((m for m, _ in self._compiled if m.accepts(*args, **kwargs)), None)
        if module is None:
            module = self._compile_for(args, kwargs)
        if len(self._by_signature) >= _MAX_SIGNATURES:
            del self._by_signature[next(iter(self._by_signature))]
        self._by_signature[key] = module
        return module

    def _compile_for(self, args: tuple, kwargs: dict):
        """A new module for the call (its arguments the example), and the warning why."""
        call = _described(args, kwargs, self._names)
        changes, dims, other = _changes(self._compiled[-1][1], call) if self._compiled \
            else ([], [], False)
        if len(self._compiled) >= self.max_modules:
            raise RecompileLimitError(
                f"this call needs a new compiled module ({'; '.join(changes)}), and "
                f"max_modules={self.max_modules} modules are compiled already",
                where=f"a call of kiln.compile({self._model_name}) (no example args)",
                hint=_hint(dims, other) + " Or raise the limit: kiln.compile(model, "
                "max_modules=N).")
        target = self._target if self._target is not None else _device_target(call)
        # a call outside dynamic_shapes' bounds fails here (ShapeError), before any warning
        kw = dict(self._kw)
        if kw.get("dynamic_shapes") is not None:  # its entries fit to the call's form
            kw["dynamic_shapes"] = self._binder.dynamic_shapes_for(kw["dynamic_shapes"],
                                                                   args, kwargs)
        module = self._compile(self._model, args, kwargs, target=target, **kw)
        self._compiled.append((module, call))
        if len(self._compiled) > 1:
            warnings.warn(KilnWarning(
                f"kiln.compile({self._model_name}) recompiled (module "
                f"{len(self._compiled)} of at most {self.max_modules}): {'; '.join(changes)}.",
                hint=_hint(dims, other)), stacklevel=4)
        return module

    @property
    def _model_name(self) -> str:
        return type(self._model).__name__

    def _one(self, what: str):
        """The one compiled module, for `what` (a method or attribute it offers)."""
        if len(self._compiled) == 1:
            return self._compiled[0][0]
        where = f"kiln.compile({self._model_name}) without example args"
        if not self._compiled:
            raise LazyModuleError(
                f"{what!r} needs a compiled module, and this one compiles on its first "
                "call, which has not happened yet", where=where,
                hint="call it once with real inputs first, or compile ahead of time with "
                "example args: kiln.compile(model, args)")
        raise LazyModuleError(
            f"{what!r} needs one compiled module, and this one holds "
            f"{len(self._compiled)}, one per call signature met", where=where,
            hint=f"take one from .modules (e.g. .modules[0].{what}), or compile one module "
            "with example args and bounded dynamic_shapes: kiln.compile(model, args, "
            "dynamic_shapes=...)")

    def save(self, path) -> None:
        """Write the compiled module to `path` (kiln.load reads it back)."""
        self._one("save").save(path)

    def explain(self, kernels: bool = False, timings: bool = False) -> str:
        """The compiled module's `kiln explain` report."""
        return self._one("explain").explain(kernels=kernels, timings=timings)

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never forwarded: copy and pickle probe these
            raise AttributeError(name)
        return getattr(self._one(name), name)

    def __repr__(self) -> str:
        return (f"LazyModule({self._model_name}, compiled={len(self._compiled)}, "
                f"max_modules={self.max_modules})")


def _signature(args: tuple, kwargs: dict):
    """A hashable key for the call: equal keys, one compiled module."""
    if not kwargs and all(type(a) is torch.Tensor for a in args):  # the common call, fast
        return tuple((a.shape, a.dtype, a.device) for a in args)
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    return spec, tuple(_leaf_key(x) for x in leaves)


def _leaf_key(x):
    if isinstance(x, torch.Tensor):
        return x.shape, x.dtype, x.device
    try:
        hash(x)
    except TypeError:  # not hashable: this object alone (a kept module may accept others)
        return type(x), id(x)
    return type(x), x


def _parameter_names(model) -> list[str]:
    """forward's positional parameter names, to name arguments in messages."""
    try:
        params = inspect.signature(model.forward if isinstance(model, torch.nn.Module)
                                   else model).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _described(args: tuple, kwargs: dict, names: list[str]) -> list[tuple[str, tuple, str]]:
    """(argument name, what it is, how it was passed) per leaf of the call, for messages."""
    flat, _ = pytree.tree_flatten_with_path((args, dict(sorted(kwargs.items()))))
    out = []
    for path, x in flat:
        key, rest = path[1], pytree.keystr(path[2:])
        if path[0].idx == 1:
            who, how = repr(key.key), f"{key.key}={rest}"
        else:
            who = repr(names[key.idx]) if key.idx < len(names) else f"args[{key.idx}]"
            how = f"args[{key.idx}]{rest}"
        what = ("tensor", tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) \
            else ("value", x)
        out.append((who + rest, what, how))
    return out


def _changes(old: list, new: list) -> tuple[list[str], list[tuple[str, int]], bool]:
    """What differs between two described calls: the changes in words, the (argument,
    dim) whose size changed, and whether anything but a size did."""
    if [h for _, _, h in old] != [h for _, _, h in new]:
        return [f"it passes {', '.join(h for _, _, h in new) or 'nothing'}, the compiled "
                f"call passed {', '.join(h for _, _, h in old) or 'nothing'}"], [], True
    changes, dims, other = [], [], False
    for (who, a, _), (_, b, _) in zip(old, new):
        if a[0] != b[0]:
            other = True
            changes.append(f"argument {who} is {_kind(b)}, was {_kind(a)}")
        elif a[0] == "value":
            if not _same(a[1], b[1]):
                other = True
                changes.append(f"argument {who} is {b[1]!r}, was {a[1]!r}")
        else:
            (_, s0, t0, d0), (_, s1, t1, d1) = a, b
            if len(s0) != len(s1):
                other = True
                changes.append(f"argument {who} has {len(s1)} dims {list(s1)}, was "
                               f"{len(s0)} {list(s0)}")
            for d, (x, y) in enumerate(zip(s0, s1) if len(s0) == len(s1) else ()):
                if x != y:
                    dims.append((who, d))
                    changes.append(f"argument {who} dim {d} is {y}, was {x}")
            for name, x, y in (("dtype", t0, t1), ("device", d0, d1)):
                if x != y:
                    other = True
                    changes.append(f"argument {who} {name} is {y}, was {x}")
    return changes, dims, other


def _kind(what: tuple) -> str:
    return "a tensor" if what[0] == "tensor" else f"a {type(what[1]).__name__}"


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an == that gives no bool (an array's): only itself is the same
        return a is b


def _hint(dims: list[tuple[str, int]], other: bool) -> str:
    """What to do instead of recompiling, for what changed."""
    parts = []
    if dims:
        by_arg: dict[str, list[str]] = {}
        for who, d in dims:  # a named argument's own dims; nested ones are the user's to spell
            if who.startswith("'") and who.endswith("'"):
                by_arg.setdefault(who, []).append(
                    f'{d}: kiln.Dim("{who[1:-1]}_{d}", min=1, max=LARGEST)')
        spec = ", ".join(f"{who}: {{{', '.join(ds)}}}" for who, ds in by_arg.items())
        example = f"={{{spec}}}" if spec else "=..."
        parts.append("Compile once with example args and dynamic_shapes whose Dims bound "
                     "every size you will call with, so one module serves them all: "
                     f"kiln.compile(model, args, dynamic_shapes{example}) (kiln bounds "
                     "every dynamic dim, so it makes none dynamic on its own).")
    if other:
        parts.append("A new dtype, device, rank, non-tensor value or argument structure "
                     "needs a module of its own: call with what was compiled for, or "
                     "compile each ahead of time with kiln.compile(model, args).")
    return " ".join(parts)


def _device_target(call: list) -> str:
    """The target for a call's tensors: "cuda" for CUDA tensors, "cpu" for the rest."""
    first: dict[str, str] = {}
    for who, what, _ in call:
        if what[0] == "tensor":
            first.setdefault(what[3].type, who)
    if len(first) > 1:
        raise DeviceError(
            "the call's tensors are on several kinds of device ("
            + ", ".join(f"argument {who} on {kind}" for kind, who in first.items())
            + "), so which to compile for is unclear", where="the first call of "
            "kiln.compile(model) without example args",
            hint="move them to one device, or name it: kiln.compile(model, target=\"cuda\")")
    return "cuda" if "cuda" in first else "cpu"
