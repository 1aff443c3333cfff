"""Errors kiln raises for bad input: each says what went wrong, where, and what to do.

A user's mistake must never surface as a raw traceback from deep inside kiln, so
every stage converts what it detects into one of these classes.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


class KilnError(Exception):
    """Base class: `what` happened, `where` (a source line or object), and a `hint`."""

    def __init__(self, what: str, where: str | None = None, hint: str | None = None):
        self.what = what
        self.where = where
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        parts = [self.what]
        if self.where:
            parts.append(f"  where: {self.where}")
        if self.hint:
            parts.append(f"  hint: {self.hint}")
        return "\n".join(parts)


class KilnWarning(UserWarning):
    """Something a user should know that does not stop the compile (an op kiln falls
    back on PyTorch for). `warnings.simplefilter("error", KilnWarning)` makes it stop.
    `cli_hint` says what to do in the command line's own words."""

    def __init__(self, what: str, hint: str | None = None, cli_hint: str | None = None):
        self.what, self.hint, self.cli_hint = what, hint, cli_hint or hint
        super().__init__(what + (f" {hint}" if hint else ""))


class UnsupportedOpError(KilnError):
    """The model uses an operation kiln cannot compile."""


class ExportError(KilnError):
    """torch.export could not capture the model."""


class ShapeError(KilnError):
    """A shape is wrong, or a size falls outside its declared bounds."""


class DTypeError(KilnError):
    """An argument has a dtype the compiled module was not compiled for."""


class ArgumentError(KilnError):
    """The call's arguments do not match the compiled signature (count or structure)."""


class IndexOutOfRangeError(KilnError, IndexError):
    """An index tensor held a position outside the dim it indexes, found at run time.
    Eager PyTorch raises IndexError for the same call, so this is one too."""


class DeviceError(KilnError):
    """A device is used but not declared, or a tensor is on the wrong device."""


class AffinityError(KilnError):
    """Placements that cannot all hold: one value pinned to two devices."""


class DistributedError(KilnError):
    """A multi-process run went wrong: no process group, a peer gone, a timeout."""


class TargetError(KilnError):
    """An unknown target, or a target that cannot be used on this machine."""


class ResourceError(KilnError):
    """A kernel cannot fit the target's limits (shared memory, registers, threads)."""


class CheckpointError(KilnError):
    """A checkpoint is missing, truncated, or does not match the model."""


class ArtifactError(KilnError):
    """A saved kiln artifact cannot be read."""


class LazyModuleError(KilnError, AttributeError):
    """A lazily compiled module (kiln.compile without example args) was asked for what
    only one compiled module has (save, explain, plan) before its first call, or while
    it holds several. An AttributeError too, so hasattr and getattr's default work."""


class RecompileLimitError(KilnError):
    """A lazily compiled module met more call signatures than it may compile modules for."""


class VerifierError(KilnError):
    """An IR invariant was broken; names the pass that broke it. A kiln bug, not the user's."""


def user_frame(stack_trace: str | None) -> str | None:
    """The innermost frame of `stack_trace` that is the user's code, as 'file:line in fn: code'.

    FX nodes keep the Python stack that created them; the last frame outside torch
    and kiln is the model line a user recognises.
    """
    if not stack_trace:
        return None
    lines = stack_trace.rstrip().splitlines()
    best = None
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if not m or _is_internal(m.group("file")):
            continue
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        code = nxt.strip() if not _FRAME.search(nxt) else ""
        best = f"{m.group('file')}:{m.group('line')} in {m.group('fn')}"
        if code:
            best += f": {code}"
    return best


def library_frame(stack_trace: str | None) -> str | None:
    """The innermost frame of `stack_trace` in transformers (a model library's code the
    user did not write), as user_frame gives it: where no frame is the user's own, the
    library line that did it beats torch's message."""
    spec = importlib.util.find_spec("transformers")
    roots = [os.path.abspath(p) for p in (spec.submodule_search_locations or [])] \
        if spec is not None else []
    best = None
    lines = (stack_trace or "").rstrip().splitlines()
    for i, line in enumerate(lines):
        m = _FRAME.search(line)
        if m and any(_under(os.path.abspath(m.group("file")), r) for r in roots):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            code = nxt.strip() if not _FRAME.search(nxt) else ""
            best = f"{m.group('file')}:{m.group('line')} in {m.group('fn')}" + (
                f": {code}" if code else "")
    return best


@functools.cache
def _internal_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(directories whose frames are library code, kiln directories that are user code).

    Found from where the packages really live, not from path names, so a user's
    checkout in a folder called `kiln` or `torch` still counts as the user's code.
    kiln/models is kiln's own *user* of the API: its lines are what a user of the
    built-in models recognises.
    """
    kiln_dir = os.path.dirname(os.path.abspath(__file__))
    roots = [kiln_dir]
    for pkg in ("torch", "triton", "transformers"):
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(os.path.abspath(p) for p in spec.submodule_search_locations)
    return tuple(roots), (os.path.join(kiln_dir, "models"),)


@functools.cache
def _stdlib() -> str:
    return os.path.dirname(os.path.abspath(functools.__file__))


def _is_internal(file: str) -> bool:
    if file.startswith("<"):  # <frozen importlib._bootstrap>, <string>, ...
        return True
    path = os.path.abspath(file)
    roots, user = _internal_roots()
    if any(_under(path, u) for u in user):
        return False
    if any(_under(path, r) for r in roots):
        return True
    return _under(path, _stdlib()) and "-packages" + os.sep not in path


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
