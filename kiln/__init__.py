"""kiln: an ahead-of-time ML compiler and runtime for LLM inference."""

import importlib

from kiln import errors, ops
from kiln.settings import setup_logging as _setup_logging
from kiln.target import TARGETS as targets
from kiln.target import Target, get_target
from kiln.version import __version__ as __version__

__all__ = ["compile", "compile_session", "load", "save_modules", "load_modules", "Dim",
           "targets", "Target", "get_target", "errors", "CompiledModule", "ops"]

# The compiler's entry points are imported on first use. Why: every tuning worker
# imports kiln.codegen.build (Triton's compiler and kiln's kernel specs) and nothing
# else of kiln; importing the whole pipeline (torch.export, dynamo) as the package's
# side effect took a worker 4.0 s (2.7 s of CPU) to start, and a GPU compile starts
# one a core but one, at once, beside the model's export.
_LAZY = {"compile": "kiln.api", "compile_session": "kiln.api", "load": "kiln.api",
         "save_modules": "kiln.api", "load_modules": "kiln.api",
         "CompiledModule": "kiln.compiled_module", "Dim": "torch.export"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


_setup_logging()  # KILN_LOG works for library users too (kiln.settings)
