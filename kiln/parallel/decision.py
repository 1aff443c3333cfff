"""What a sharding rule decides for one op, and the helpers every rule reads.

A Decision says how the op needs each input (`wants`: the pass gets it there, for free
when the input is a weight not yet cut, else with a local slice or a collective) and
how its output is sharded (`out`; a list for an op returning several tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from kiln.parallel.sharding import REPLICATE, Sharding


@dataclass
class Decision:
    out: Sharding | list[Sharding]
    wants: dict[fx.Node, Sharding] = field(default_factory=dict)
    # a rewrite the pass applies: "vocab_parallel_embedding", "expert_parallel_ids"
    rewrite: str | None = None


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def shape(node: fx.Node) -> tuple:
    return tuple(node.meta["val"].shape)


def replicated(node: fx.Node) -> Decision:
    """Every input whole, every output whole: always correct, only slower."""
    val = node.meta.get("val")
    out = [REPLICATE] * len(val) if isinstance(val, (tuple, list)) else REPLICATE
    return Decision(out, {a: REPLICATE for a in tensor_inputs(node)})
