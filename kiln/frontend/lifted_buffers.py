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
A plain tensor attribute the forward writes in place (Meta's Llama: `self.cache_k =
torch.zeros(...)` in __init__, `self.cache_k[:bsz, start:start + seqlen] = xk` in
forward) is lifted as a constant too, and torch cannot functionalize a constant's
writes (its re-trace raises, or the writes are lost): such attributes are registered
as non-persistent buffers for a second export (`export_with_state`) and put back as
they were after it, so the writes are the compiled module's state, as a registered
cache's are. A constant written in place that is no attribute at all is refused with
what to do.
"""

from __future__ import annotations

import contextlib

import torch
from torch.export.graph_signature import InputKind

from kiln.errors import ExportError


def export_with_state(export, model: torch.nn.Module) -> torch.export.ExportedProgram:
    """`export()`'s program, exported again with the plain tensor attributes its forward
    writes in place registered as buffers while it runs; lifted buffers read as such."""
    ep = export()
    written = written_attributes(ep, model)
    if not written:
        return constants_as_buffers(ep, model)
    with _as_buffers(model, written):
        return constants_as_buffers(export(), model)


def written_attributes(ep: torch.export.ExportedProgram, model: torch.nn.Module) -> list[str]:
    """The lifted constants that are plain tensor attributes of a module of `model` and
    that the program writes in place (through views and no-op `.to`s too)."""
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    return [s.target for s in ep.graph_signature.input_specs
            if s.kind == InputKind.CONSTANT_TENSOR and _written(placeholders[s.arg.name])
            and _is_attribute(model, s.target, ep.constants.get(s.target))]


@contextlib.contextmanager
def _as_buffers(model: torch.nn.Module, targets: list[str]):
    """Inside: each target attribute a non-persistent buffer of its module."""
    held = []
    for target in targets:
        owner, _, leaf = target.rpartition(".")
        module = model.get_submodule(owner)
        tensor = module.__dict__.pop(leaf)
        module.register_buffer(leaf, tensor, persistent=False)
        held.append((module, leaf, tensor))
    try:
        yield
    finally:
        for module, leaf, tensor in held:
            module._buffers.pop(leaf, None)
            module.__dict__[leaf] = tensor


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
    """Whether an in-place op (a schema argument it writes) takes `node` or a view of it
    (a slice, a `.to` that returns its input)."""
    for user in node.users:
        schema = getattr(user.target, "_schema", None)
        for i, arg in enumerate(schema.arguments if schema else ()):
            info = arg.alias_info
            value = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            if value is not node or info is None:
                continue
            if info.is_write:
                return True
            if any(r.alias_info is not None for r in schema.returns) and _written(user):
                return True
    return False
