"""Whether an exception that stopped torch.export was raised by the model's own code.

Why: a model that raises by itself on its arguments (transformers' Bamba with its default
config raises ValueError from its cache in eager PyTorch too) got "torch.export could not
capture the model" and a hint about data-dependent control flow: the wrong thing to fix.
An exception whose innermost frame is neither torch's nor kiln's is the model's (or its
library's) own check of its arguments or config, and the error should say so.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import traceback

# plain Python errors a model raises itself; torch's own failures (RuntimeError from an
# op, torch.export's UserError...) end in torch's frames or are other types
MODEL_ERRORS = (ValueError, TypeError, KeyError, IndexError, AssertionError,
                NotImplementedError, AttributeError)


@functools.cache
def _not_the_model() -> tuple[str, ...]:
    """torch's and kiln's package directories."""
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        roots.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
    return tuple(r.rstrip(os.sep) + os.sep for r in roots)


def _where(frame) -> str:
    where = f"{frame.filename}:{frame.lineno} in {frame.name}"
    return f"{where}: {frame.line.strip()}" if frame.line else where


def model_frame(e: BaseException) -> str | None:
    """'file:line in fn: code' of the innermost frame of `e`'s traceback that is neither
    torch's nor kiln's (the model's line, in a library such as transformers too), or None."""
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        path = os.path.abspath(frame.filename)
        if not frame.filename.startswith("<") and not path.startswith(_not_the_model()):
            return _where(frame)
    return None


def raised_by_model(e: BaseException) -> str | None:
    """'file:line in fn: code' where the model's code raised `e`, or None when `e` is not
    a plain Python error or was raised inside torch or kiln."""
    if not isinstance(e, MODEL_ERRORS):
        return None
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    path = os.path.abspath(last.filename)
    if last.filename.startswith("<") or path.startswith(_not_the_model()):
        return None
    return _where(last)
