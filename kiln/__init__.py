"""kiln: an ahead-of-time ML compiler and runtime for LLM inference."""

from torch.export import Dim

from kiln import errors
from kiln.api import CompiledModule, compile, load
from kiln.target import TARGETS as targets
from kiln.target import Target, get_target
from kiln.version import __version__ as __version__

__all__ = ["compile", "load", "Dim", "targets", "Target", "get_target", "errors",
           "CompiledModule"]
