"""The import stage as a pipeline pass: what the user handed kiln.compile -> KilnGraph."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kiln.frontend.export import import_model
from kiln.ir.graph import KilnGraph, named_devices
from kiln.pipeline import Context, Pass


@dataclass
class ModelSource:
    """The import stage's input: what the user handed to kiln.compile."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    dynamic_shapes: Any

    def describe(self) -> str:
        return f"model {type(self.model).__name__} with {len(self.args)} args"


def _import(src: ModelSource, ctx: Context) -> KilnGraph:
    kg = import_model(src.model, src.args, src.kwargs, src.dynamic_shapes,
                      fallback=ctx.options.get("fallback", "allow"),
                      allow_train=ctx.options.get("allow_train", False))
    # The weights leave the IR here; kiln.compile hands them to the CompiledModule.
    ctx.options["state"] = kg.state
    kg.devices_named = named_devices(kg)
    ctx.options["fallback_ops"] = kg.fallback_ops
    return kg


import_pass = Pass("export", _import)
