"""LLM families written once, readable top to bottom, compiled by kiln.

`builtin(name)` gives the models the CLI can name without a file: a model, example
args and dynamic shapes.
"""

from __future__ import annotations

from collections.abc import Callable

BUILTINS: dict[str, Callable] = {}


def _tiny_llama(**kw):
    from kiln.models.llama import example_inputs, tiny_llama

    model = tiny_llama(**kw)
    args, dynamic = example_inputs(model.cfg, seq_len=8)
    return model, args, dynamic


BUILTINS["tiny-llama"] = _tiny_llama


def builtin(name: str):
    """(model, args, dynamic_shapes) for a built-in model name, or KeyError."""
    return BUILTINS[name]()
