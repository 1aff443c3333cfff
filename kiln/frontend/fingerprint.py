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
constants (never of parameters or buffers: a plan reads those, it is not made from
them).
"""

from __future__ import annotations

import hashlib

import torch


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
    for name, c in sorted(ep.constants.items()):
        if isinstance(c, torch.Tensor):
            put("constant", name, tensor_identity(c),
                groups.setdefault(tied_memory(c), len(groups)), _digest(c))
        else:  # a script object: its type and text
            put("constant", name, type(c).__qualname__, repr(c))
    return h.hexdigest()


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


def _digest(t: torch.Tensor) -> str | None:
    """A lifted constant's values (plain tensor attributes, tensors made in forward)."""
    if t.device.type == "meta":
        return None
    # flat first: a 0-dim tensor (Gemma's embedding normaliser) has no bytes view
    data = t.detach().contiguous().cpu().reshape(-1)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()
                          if data.numel() else b"").hexdigest()
