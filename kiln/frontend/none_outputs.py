"""A None that forward returns among its outputs is put back by the compiled module.

torch.export returns a None inside a returned list or tuple (Llava's output holds its
vision tower's output, whose `pooler_output` and some `hidden_states` entries are None)
as a constant output leaf. kiln's programs produce tensors only, so such models were
refused. The Nones leave the graph's outputs here; their leaf positions go with the
plan (DispatchPlan.none_outputs), and the module inserts None there on every call.
Constants other than None are still refused (form_regions).
"""

from __future__ import annotations

import torch.fx as fx
from torch.export.graph_signature import ConstantArgument, OutputKind, OutputSpec


def drop_none_outputs(gm: fx.GraphModule,
                      specs: list[OutputSpec]) -> tuple[list[OutputSpec], tuple[int, ...]]:
    """The output specs without the None user outputs, and those outputs' positions
    among the user outputs (the flattened output's leaves); the graph's output node
    loses the same entries."""
    drop = [i for i, s in enumerate(specs) if s.kind == OutputKind.USER_OUTPUT
            and isinstance(s.arg, ConstantArgument) and s.arg.value is None]
    if not drop:
        return specs, ()
    users = [i for i, s in enumerate(specs) if s.kind == OutputKind.USER_OUTPUT]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    output.args = (tuple(v for i, v in enumerate(output.args[0]) if i not in drop),)
    gm.recompile()
    return [s for i, s in enumerate(specs) if i not in drop], tuple(users.index(i)
                                                                     for i in drop)
