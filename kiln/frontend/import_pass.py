"""The import stage as a pipeline pass: what the user handed kiln.compile -> KilnGraph."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ArgumentError
from kiln.frontend.export import capture, import_exported
from kiln.frontend.position_tables import check_position_tables
from kiln.ir.graph import KilnGraph, named_devices
from kiln.pipeline import Context, Pass


@dataclass
class ModelSource:
    """The import stage's input: what the user handed to kiln.compile."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    dynamic_shapes: Any
    # what torch.export captured, when kiln.compile has captured it already (to look the
    # program up in the compile cache)
    exported: torch.export.ExportedProgram | None = None

    def describe(self) -> str:
        return f"model {type(self.model).__name__} with {len(self.args)} args"


def _import(src: ModelSource, ctx: Context) -> KilnGraph:
    ep = src.exported
    if ep is None:
        ep = capture(src.model, src.args, src.kwargs, src.dynamic_shapes,
                     allow_train=ctx.options.get("allow_train", False))
    kg = import_exported(ep, src.model, src.args, src.kwargs, src.dynamic_shapes,
                         fallback=ctx.options.get("fallback", "allow"))
    _check_pin_names(kg.state, ctx.options.get("pins") or {})
    check_position_tables(kg)
    # The weights leave the IR here; kiln.compile hands them to the CompiledModule.
    ctx.options["state"] = kg.state
    # as imported: a tensor later passes put in its place (folded from weight values)
    # keeps the compile out of the compile cache
    ctx.options["imported_state"] = dict(kg.state)
    # ...unless a pass recorded how it follows from a model tensor (ir/derived.py)
    ctx.options["derived"] = kg.derived
    # ...and a plan decided by a tensor's values is kept with them (graph/index_forms.py)
    ctx.options["values_read"] = kg.values_read
    kg.devices_named = named_devices(kg)
    ctx.options["fallback_ops"] = kg.fallback_ops
    return kg


def _check_pin_names(state: dict, pins: dict[str, int]) -> None:
    """A pin (kiln.compile's pins=) names a weight or buffer of the model; a misspelt one
    would pin nothing. Checked here, where the whole model's state is known (a pipeline
    stage later holds only its own)."""
    for name in pins:
        if name not in state:
            close = difflib.get_close_matches(name, list(state), n=1)
            raise ArgumentError(
                f"pins names {name!r}, which is not a weight or buffer of the model",
                hint=(f"did you mean {close[0]!r}? " if close else "")
                + "pins take state-dict names (model.state_dict().keys())")


import_pass = Pass("export", _import)
