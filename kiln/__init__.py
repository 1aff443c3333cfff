"""kiln: an ahead-of-time ML compiler and runtime for LLM inference."""

from torch.export import Dim

from kiln import errors, ops
from kiln.api import compile, compile_session, load, load_modules, save_modules
from kiln.compiled_module import CompiledModule
from kiln.settings import setup_logging as _setup_logging
from kiln.target import TARGETS as targets
from kiln.target import Target, get_target
from kiln.version import __version__ as __version__

__all__ = ["compile", "compile_session", "load", "save_modules", "load_modules", "Dim",
           "targets", "Target", "get_target", "errors", "CompiledModule", "ops"]

_setup_logging()  # KILN_LOG works for library users too (kiln.settings)
