"""The graph-level IR: a core-ATen FX graph plus what kiln needs around it.

Placeholders are user inputs, parameters, buffers and lifted constants (named, never
inlined). Outputs are user outputs and buffer mutations (the new value of a buffer
the model updated in place, e.g. a KV cache written with index_copy_). Every node
keeps `meta["val"]` (a fake tensor whose sizes are symbolic) and its stack trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from kiln.errors import user_frame
from kiln.ir.derived import Derivation
from kiln.ir.symbolic import Bounds, Dim, as_dim


@dataclass
class GraphInput:
    name: str  # placeholder name
    kind: str  # "user" | "user_const" | "user_size" | "param" | "buffer" | "constant" | "recv"
    target: str | None = None  # state-dict name for param/buffer/constant; "recv": sender's value
    # "user_const": a non-tensor argument export specialised on; "user_size": the size
    # symbol a dynamic int argument is (bound from it at call time)
    value: object = None
    stage: int | None = None  # for "recv": the pipeline stage that sends it


@dataclass
class GraphOutput:
    name: str  # node name of the returned value
    kind: str  # "user" | "buffer_mutation" | "send"
    target: str | None = None  # the buffer a mutation writes
    stages: tuple[int, ...] = ()  # for "send": the later pipeline stages that receive it


@dataclass
class KilnGraph:
    module: fx.GraphModule
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    symbols: dict[str, Bounds]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    state: dict[str, torch.Tensor]  # params, buffers, constants by state-dict name
    mutable: set[str] = field(default_factory=set)  # state names the model updates
    # size symbol -> the user's torch.export.Dim name ("s17" -> "seq"), for messages
    dim_names: dict[str, str] = field(default_factory=dict)
    # device index the model's own code names (cuda:3) -> [(node, source line)], recorded
    # at import: constant folding may erase the ops that named them
    devices_named: dict[int, list[tuple[str, str | None]]] = field(default_factory=dict)
    # ops kiln has no kernel for that run as PyTorch's own op -> where each is used
    fallback_ops: dict[str, list[str]] = field(default_factory=dict)
    # guards over the int arguments' symbols checked on every call: (lhs - rhs, relation,
    # torch's text), e.g. (s27 + s30 - 16, "<=", "s27 + s30 <= 16") (frontend/int_args.py)
    size_checks: list = field(default_factory=list)
    # this rank's pipeline stage (kiln.parallel.pipeline_stages.StageIO); None: one stage
    stage_io: object = None
    # state name of a tensor a pass made from a model tensor's values -> how, so the
    # compile cache can keep the recipe instead of the values (ir/derived.py)
    derived: dict[str, Derivation] = field(default_factory=dict)
    # state names whose values decided a rewrite without being folded (a mask buffer
    # proved a tril of ones): the compile cache checks them at a hit (values_read)
    values_read: set[str] = field(default_factory=set)
    # leaf positions of the returned Nones among the user outputs (frontend/none_outputs)
    none_outputs: tuple[int, ...] = ()

    @property
    def graph(self) -> fx.Graph:
        return self.module.graph

    def placeholders(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.graph.nodes if n.op == "placeholder"}

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.graph.nodes) if n.op == "output")

    def output_values(self) -> list:
        return list(self.output_node().args[0])

    def fake_mode(self):
        for n in self.graph.nodes:
            val = n.meta.get("val")
            if isinstance(val, torch.Tensor) and hasattr(val, "fake_mode"):
                return val.fake_mode
        return None

    def recompile(self) -> None:
        self.graph.lint()
        self.module.recompile()


def shape_of(node: fx.Node) -> tuple[Dim, ...]:
    return tuple(as_dim(d) for d in node.meta["val"].shape)


def dtype_of(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def is_tensor_node(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def where(node: fx.Node) -> str | None:
    """The user's source line that created `node`, for error messages."""
    return user_frame(node.meta.get("stack_trace"))


def named_devices(kg: KilnGraph) -> dict[int, list[tuple[str, str | None]]]:
    """Accelerator device indices the model's code names in `device=` arguments
    (`.to("cuda:3")`, `torch.ones(..., device="cuda:3")`), with the nodes."""
    used: dict[int, list[tuple[str, str | None]]] = {}
    for node in kg.graph.nodes:
        devs = [v for v in (*node.args, *node.kwargs.values()) if isinstance(v, torch.device)]
        for dev in devs:
            if dev.type not in ("cpu", "meta") and dev.index is not None:
                entries = used.setdefault(dev.index, [])
                if all(n != node.name for n, _ in entries):
                    entries.append((node.name, where(node)))
    return used


def infer_meta(kg: KilnGraph, node: fx.Node) -> None:
    """Fill `node.meta['val']` by running its op on the fake inputs (for nodes a pass adds)."""

    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    mode = kg.fake_mode()
    args = fx.node.map_arg(node.args, val)
    kwargs = fx.node.map_arg(node.kwargs, val)
    with mode:
        node.meta["val"] = node.target(*args, **kwargs)


def add_node(kg: KilnGraph, before: fx.Node, target, args, kwargs=None, like=None) -> fx.Node:
    """Insert `target(*args)` before `before`: meta inferred, `like`'s stack trace kept."""
    with kg.graph.inserting_before(before):
        node = kg.graph.call_function(target, tuple(args), dict(kwargs or {}))
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    infer_meta(kg, node)
    return node
