"""Turn generated Triton source into a kernel object.

Triton reads a kernel's source through `inspect`, so generated code is written to a
real file (KILN_CACHE_DIR/kernels/<hash>.py) and imported. With `interpret=True` the
module is imported with TRITON_INTERPRET=1, which makes `@triton.jit` build an
interpreter function that runs on CPU tensors (tests, and the `interpret` target).
Triton's own jit'd library functions (tl.max, tl.sum, tl.zeros, ...) were built when
triton was imported, without the interpreter; while an interpreted kernel runs they
are swapped for interpreted twins (`_interpreted_stdlib`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

from kiln.settings import cache_dir as settings_cache_dir

_lock = threading.Lock()
_modules: dict[tuple[str, bool], object] = {}


def cache_dir() -> Path:
    return settings_cache_dir()


def source_file(source: str) -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = cache_dir() / "kernels" / f"k_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        tmp.replace(path)
    return path


def load_kernel(source: str, name: str, interpret: bool = False):
    """The kernel `name` defined in `source` (a JITFunction, or an interpreter function)."""
    key = (source, interpret)
    with _lock:
        module = _modules.get(key)
        if module is None:
            path = source_file(source)
            mod_name = f"kiln_kernel_{path.stem}{'_interp' if interpret else ''}"
            spec = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec)
            old = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
            try:
                spec.loader.exec_module(module)
            finally:
                if old is None:
                    os.environ.pop("TRITON_INTERPRET", None)
                else:
                    os.environ["TRITON_INTERPRET"] = old
            _modules[key] = module
    fn = getattr(module, name)
    return _Interpreted(fn) if interpret else fn


class _Interpreted:
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
