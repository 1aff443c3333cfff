"""Turn generated Triton source into a kernel object.

Triton reads a kernel's source through `inspect`, so generated code is written to a
real file (KILN_CACHE_DIR/kernels/<hash>.py) and imported. With `interpret=True` the
module is imported with TRITON_INTERPRET=1, which makes `@triton.jit` build an
interpreter function that runs on CPU tensors (tests, and the `interpret` target);
interpreter.py makes such a function launchable beside GPU compiles.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import threading
from pathlib import Path

from kiln.codegen.build.interpreter import Interpreted
from kiln.settings import cache_dir

_lock = threading.Lock()
_modules: dict[tuple[str, bool], object] = {}



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
    # a kernel with device asserts (index checks) runs with them checked
    return Interpreted(fn, debug="tl.device_assert(" in source) if interpret else fn
