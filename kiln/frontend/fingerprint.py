"""A captured program's fingerprint: a hash of everything kiln's compile reads from it.

Why: decomposing a captured Llama-3-8B and running kiln's passes on it take most of a
compile; the compile cache (kiln/artifact/compile_cache.py) keeps the result under
this fingerprint, so a second compile of the same model skips them. It is taken
after torch.export, not from the model's source, so whatever decided the program
(the model's code wherever it lives, its config, patched functions, environment
variables its code reads) is seen through the program itself: a model whose program
changed gets a new fingerprint, one whose program did not needs nothing recompiled.

It covers the graph's code (ops, arguments, node names), every node's value (shape
with its symbols, strides, dtype, device), source lines and module paths (kiln's
messages and pipeline stages read them), the signature, the symbols' ranges, the
argument structures, and the state: each tensor's name, shape, strides, dtype, device,
whether it is the same memory as another (tied weights), and the values of lifted
constants and of non-persistent buffers the program only reads (never of parameters,
persistent buffers or buffers it writes: a plan reads those, it is not made from them).
"""

from __future__ import annotations

import hashlib

import torch
from torch.export.graph_signature import InputKind


def program_fingerprint(ep: torch.export.ExportedProgram) -> str:
    h = hashlib.sha256()

    def put(*parts) -> None:
        h.update(repr(parts).encode())
        h.update(b"\0")

    gm = ep.graph_module
    put("code", gm.code)
    for node in gm.graph.nodes:
        meta = node.meta
        put(node.name, node.op, str(node.target), _value(meta.get("val")),
            meta.get("stack_trace"), _module_stack(meta.get("nn_module_stack")))
    sig = ep.graph_signature
    put("inputs", [(s.kind.name, getattr(s.arg, "name", repr(s.arg)), s.target,
                    getattr(s, "persistent", None)) for s in sig.input_specs])
    put("outputs", [(s.kind.name, getattr(s.arg, "name", repr(s.arg)), s.target)
                    for s in sig.output_specs])
    put("ranges", sorted((str(k), str(v)) for k, v in ep.range_constraints.items()))
    put("specs", str(ep.call_spec.in_spec), str(ep.call_spec.out_spec))
    groups: dict[tuple, int] = {}
    for name, t in sorted(ep.state_dict.items()):
        put("state", name, tensor_identity(t), isinstance(t, torch.nn.Parameter),
            groups.setdefault(tied_memory(t), len(groups)))
    written = written_buffers(ep)
    for name, c in sorted(ep.constants.items()):
        if isinstance(c, torch.Tensor):
            # a non-persistent buffer the program writes (a KV cache: 1 GB of an 8B LLM's,
            # ~3 s a module to copy and hash on a GPU machine) is state, never folded
            put("constant", name, tensor_identity(c),
                groups.setdefault(tied_memory(c), len(groups)),
                "written" if name in written else value_digest(c))
        else:  # a script object: its type and text
            put("constant", name, type(c).__qualname__, repr(c))
    return h.hexdigest()


def written_buffers(ep: torch.export.ExportedProgram) -> set[str]:
    """The buffers the captured program writes in place, directly or through a view of
    one (its ops are not functionalized yet: `cache.index_copy_`, `cache[:, pos] = x`)."""
    buffers = {s.arg.name: s.target for s in ep.graph_signature.input_specs
               if s.kind == InputKind.BUFFER}
    out = set()
    for node in ep.graph_module.graph.nodes:
        schema = _schema(node)
        if schema is None:
            continue
        for i, a in enumerate(schema.arguments):
            arg = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write \
                    and isinstance(arg, torch.fx.Node):
                base = _aliased_base(arg)
                if base.name in buffers:
                    out.add(buffers[base.name])
    return out


def _schema(node: torch.fx.Node):
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema
    return None


def _aliased_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` is (through views and in-place results)."""
    while True:
        schema = _schema(node)
        if schema is None or not schema.returns or schema.returns[0].alias_info is None \
                or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return node
        node = node.args[0]


def _value(v):
    if isinstance(v, torch.Tensor):
        return tensor_identity(v)
    if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("sym", str(v.node.expr))
    if isinstance(v, list | tuple):
        return tuple(_value(x) for x in v)
    return repr(v)


def tensor_identity(t: torch.Tensor) -> tuple:
    return ("T", tuple(_size(d) for d in t.shape), tuple(_size(s) for s in t.stride()),
            str(t.dtype), str(t.device), t.layout != torch.strided and str(t.layout))


def _size(d) -> str:
    node = getattr(d, "node", None)
    return str(node.expr) if node is not None else str(d)


def _module_stack(stack) -> tuple | None:
    if not stack:
        return None
    return tuple((k, str(v[0]), str(v[1]) if len(v) > 1 else None) for k, v in stack.items())


def tied_memory(t: torch.Tensor) -> tuple:
    """The memory a tensor views, to tell tied tensors (one memory, two names) apart."""
    if t.device.type == "meta":
        return ("meta", id(t))  # no memory to share: identity stands in for it
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(),
            tuple(t.shape), tuple(t.stride()))


def value_digest(t: torch.Tensor) -> str | None:
    """A tensor's values (a lifted constant's, or one a pass decided a rewrite by);
    None on the meta device."""
    if t.device.type == "meta":
        return None
    # flat first: a 0-dim tensor (Gemma's embedding normaliser) has no bytes view
    data = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()
                          if data.numel() else b"").hexdigest()
