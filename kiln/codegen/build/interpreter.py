"""Run an interpreted Triton kernel in a process that also compiles for GPUs.

Triton's own jit'd library functions (tl.max, tl.sum, tl.zeros, ...) were built when
triton was imported, without the interpreter; while an interpreted kernel runs they
are swapped for interpreted twins (`_interpreted_stdlib`), and put back after, so
GPU compiles in the same process see the originals.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, suppress

_lock = threading.Lock()


class Interpreted:
    """An interpreter kernel launched as `fn[grid](*args)`, with the stdlib interpretable."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpreted_stdlib():
                return self.fn[grid](*args, **kwargs)

        return launch


_twins: dict[int, object] = {}


@functools.cache
def _twin_class():
    """InterpretedFunction whose device-function call undoes its patches of triton.language.

    Triton's interpreter patches triton.language for a device function call and never
    restores it (harmless when the whole process is interpreted). Here the process also
    compiles for GPUs, so the patches of a call are rolled back when it returns (the
    kernel's own patches stay until the kernel's launch ends).
    """
    from triton.runtime.interpreter import InterpretedFunction, InterpreterError, _patch_lang

    class Twin(InterpretedFunction):
        def __call__(self, *args, **kwargs):
            scope = _patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as e:
                raise InterpreterError(repr(e)) from e
            finally:
                scope.restore()

    return Twin


@contextmanager
def _interpreted_stdlib():
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    with suppress(ImportError):  # imported lazily by the launcher: let it see the originals
        import triton.experimental.gluon  # noqa: F401
    modules = [tl, tl.core, tl.standard, tl.math]
    saved = []
    with _lock:
        try:
            for mod in modules:
                for attr, val in list(vars(mod).items()):
                    if isinstance(val, JITFunction):
                        twin = _twins.get(id(val))
                        if twin is None:
                            twin = _twins[id(val)] = _twin_class()(val.fn)
                        saved.append((mod, attr, val))
                        setattr(mod, attr, twin)
            yield
        finally:
            for mod, attr, val in saved:
                setattr(mod, attr, val)
