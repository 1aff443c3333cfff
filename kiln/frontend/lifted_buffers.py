"""Lifted constants that are the model's own buffers, read as those buffers.

Why: non-strict torch.export lifts a tensor that the forward reaches through a plain
Python object (not a module attribute) as a constant, even when it is a registered
buffer too. transformers' export recipe (`TorchExportableModuleWithStaticCache`, what
HF models are exported with for a static KV cache) registers its StaticCache's key,
value and length tensors as buffers, but the attention layers write them through the
cache object: the program then holds each tensor twice, as a buffer input and as a
constant written in place, and torch's decomposition fails on the aliased pair
(`AssertionError: expected compiled_fn to be GraphModule`). Each such constant is
replaced by the buffer input it is (the same tensor object): the writes become buffer
mutations, which kiln keeps as the model's state, as it does gpt-fast's KV cache.
A constant written in place that is no buffer at all is refused with what to do.
"""

from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind

from kiln.errors import ExportError


def constants_as_buffers(ep: torch.export.ExportedProgram,
                         model: torch.nn.Module) -> torch.export.ExportedProgram:
    """`ep` with every lifted constant that is one of `model`'s buffer inputs read
    through that input instead (in place; returned for chaining)."""
    sig = ep.graph_signature
    buffers = {id(b): name for name, b in model.named_buffers(remove_duplicate=False)}
    inputs = {s.target: s.arg.name for s in sig.input_specs if s.kind == InputKind.BUFFER}
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    kept, changed = [], False
    for spec in sig.input_specs:
        tensor = ep.constants.get(spec.target) if spec.kind == InputKind.CONSTANT_TENSOR \
            else None
        buffer = buffers.get(id(tensor)) if tensor is not None else None
        if buffer is None or buffer not in inputs:
            kept.append(spec)
            continue
        node = placeholders[spec.arg.name]
        node.replace_all_uses_with(placeholders[inputs[buffer]])
        ep.graph.erase_node(node)
        del ep.constants[spec.target]
        changed = True
    if changed:
        sig.input_specs[:] = kept
        ep.graph_module.recompile()
    for spec in kept:
        if spec.kind == InputKind.CONSTANT_TENSOR and _written(placeholders[spec.arg.name]):
            where, _, leaf = spec.target.rpartition(".")
            if _is_attribute(model, spec.target, ep.constants.get(spec.target)):
                raise ExportError(
                    f"the model writes in place to {leaf!r}, a plain tensor attribute of "
                    f"module {where or '(the top module)'} that is no registered buffer: "
                    "torch.export lifts it as a constant, and a compiled module cannot "
                    "keep a constant's new values",
                    where=f"module {where or '(the top module)'}",
                    hint=f"register it where the module sets it: self.register_buffer("
                         f"{leaf!r}, tensor, persistent=False) in place of self.{leaf} = "
                         "tensor (Meta's Llama keeps its KV cache as plain attributes)")
            raise ExportError(
                f"the model writes in place to a tensor it holds outside any module "
                f"attribute (torch.export lifted it as the constant {spec.target!r}); a "
                "compiled module cannot keep such a tensor's new values",
                where=f"module {where or '(the top module)'}",
                hint="register the tensor as a buffer of a module on the forward's path "
                     "(module.register_buffer(name, tensor, persistent=False)) and keep "
                     "reading it where it is: kiln then reads it as that buffer")
    return ep


def _is_attribute(model: torch.nn.Module, target: str, tensor) -> bool:
    """Whether `tensor`, lifted under `target`, is that attribute of a module of `model`
    (a tensor reached through a plain object is lifted as `lifted_tensor_N`)."""
    owner, _, leaf = target.rpartition(".")
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return False
    return tensor is not None and getattr(module, leaf, None) is tensor


def _written(node: torch.fx.Node) -> bool:
    """Whether an in-place op (a schema argument it writes) takes `node`."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        for i, arg in enumerate(schema.arguments if schema else ()):
            info = arg.alias_info
            value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            if value is node and info is not None and info.is_write:
                return True
    return False
