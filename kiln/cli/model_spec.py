"""Naming a model on the command line, and getting it compiled or loaded.

A model is named as `path/to/file.py:factory` (a function returning (model, args),
(model, args, dynamic_shapes) or a dict with keys model, args, kwargs,
dynamic_shapes), as a built-in (`tiny-llama`), or, for run and explain, as a saved
artifact directory. User code that fails becomes a KilnError at the user's line.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.errors import KilnError, user_frame


@dataclass
class ModelSpec:
    model: torch.nn.Module
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dynamic_shapes: object = None


def is_artifact(spec: str) -> bool:
    """An artifact directory (or a path that names one: it ends in .kiln)."""
    return ":" not in spec and (Path(spec).is_dir() or spec.rstrip("/").endswith(".kiln"))


def load_model_spec(spec: str) -> ModelSpec:
    """The model, example args and dynamic shapes named by 'file.py:factory' or a built-in."""
    from kiln.models import BUILTINS

    if spec in BUILTINS:
        return _as_model_spec(spec, BUILTINS[spec]())
    path, _, factory = spec.partition(":")
    if not factory or not path.endswith(".py"):
        close = difflib.get_close_matches(spec, list(BUILTINS), n=1)
        raise KilnError(
            f"cannot read the model name {spec!r}"
            + (f": did you mean {close[0]!r}?" if close else ""),
            hint="name a model as path/to/file.py:factory, a built-in "
            f"({', '.join(BUILTINS)}), or (run/explain) an artifact directory",
        )
    if not Path(path).is_file():
        raise KilnError(f"model file {path} does not exist",
                        hint="check the path (it is relative to the current directory)")
    module = _import_file(path)
    fn = getattr(module, factory, None)
    if not callable(fn):
        found = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                 and getattr(v, "__module__", None) == module.__name__]
        raise KilnError(f"{path} has no function {factory!r}",
                        hint="functions defined there: " + (", ".join(found) or "none"))
    out = _call_user(lambda: fn(), f"calling {spec}")
    return _as_model_spec(spec, out)


def _import_file(path: str):
    mod_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(mod_spec)
    sys.path.insert(0, str(Path(path).resolve().parent))
    try:
        _call_user(lambda: mod_spec.loader.exec_module(module), f"importing {path}")
    finally:
        sys.path.pop(0)
    return module


def _call_user(fn, doing: str):
    """Run user code; its exceptions become a KilnError pointing at the user's line."""
    try:
        return fn()
    except KilnError:
        raise
    except Exception as e:
        tb = "".join(traceback.format_tb(e.__traceback__))
        where = user_frame(tb)
        if isinstance(e, SyntaxError):
            where = f"{e.filename}:{e.lineno}: {(e.text or '').strip()}"
        raise KilnError(f"{doing} failed: {type(e).__name__}: {e}", where=where,
                        hint="fix the model file; the error is in its code, not in kiln") \
            from None


def _as_model_spec(spec: str, out) -> ModelSpec:
    want = ("the factory must return (model, args), (model, args, dynamic_shapes) or a dict "
            "with keys model, args and optionally kwargs, dynamic_shapes")
    if isinstance(out, dict):
        if "model" not in out or "args" not in out:
            raise KilnError(f"{spec} returned a dict without 'model' and 'args'", hint=want)
        if not isinstance(out.get("kwargs") or {}, dict):
            raise KilnError(f"{spec} returned kwargs of type {type(out['kwargs']).__name__}",
                            hint="kwargs is a dict of keyword arguments; " + want)
        m = ModelSpec(out["model"], out["args"], dict(out.get("kwargs") or {}),
                      out.get("dynamic_shapes"))
    elif isinstance(out, tuple) and len(out) in (2, 3):
        m = ModelSpec(out[0], out[1], {}, out[2] if len(out) == 3 else None)
    else:
        raise KilnError(f"{spec} returned {type(out).__name__}", hint=want)
    if not isinstance(m.model, torch.nn.Module):
        raise KilnError(f"{spec} returned a {type(m.model).__name__} as its model",
                        hint="the model must be a torch.nn.Module; " + want)
    m.args = tuple(m.args) if isinstance(m.args, (list, tuple)) else (m.args,)
    return m


# ---- getting a compiled module ------------------------------------------------------


def compile_options(args) -> dict | None:
    """kiln.compile's options from the command's flags (--tune)."""
    return {"tune": args.tune} if getattr(args, "tune", None) else None


def compile_model(args, spec: ModelSpec | None = None, **kw):
    """(compiled module, seconds) for args.model (or `spec`), for args.target."""
    import kiln

    spec = spec or load_model_spec(args.model)
    options = compile_options(args)
    t0 = time.perf_counter()
    exe = kiln.compile(spec.model, spec.args, spec.kwargs, dynamic_shapes=spec.dynamic_shapes,
                       target=args.target or "cpu", options=options,
                       fallback=getattr(args, "fallback", None) or "allow", **kw)
    return exe, time.perf_counter() - t0


def load_artifact(args):
    """(loaded module, seconds) for the artifact directory args.model."""
    import kiln

    t0 = time.perf_counter()
    exe = kiln.load(args.model, target=args.target)
    return exe, time.perf_counter() - t0


def compiled_or_loaded(args):
    """(compiled module, seconds, what it came from): an artifact is loaded, a model compiled."""
    if is_artifact(args.model):
        exe, secs = load_artifact(args)
        return exe, secs, "loaded"
    exe, secs = compile_model(args)
    return exe, secs, "compiled"
