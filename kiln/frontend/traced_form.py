"""A graph in the form torch's tracer records a program, for a graph kiln built by
other means (frontend/local_decompose.py splices traces into a captured program):
nodes named by their op in graph order, arguments laid out as the dispatcher hands
them to Python. kiln's passes and tests read both (FileCheck on `%view`, args[i])."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree


def as_traced(gm: fx.GraphModule) -> fx.GraphModule:
    """The graph again with every op node as torch's tracer records it, in graph order:
    named by the op's packet (`view`, `view_1`, ...; `sym_size_int` for size reads), not
    `view_default` (fx's name of an overload) nor after names the capture had taken
    (the re-trace's `add` would otherwise be `add_tensor`, its `add_1` the capture's
    `add`); arguments in the dispatcher's form (_dispatched). Placeholders keep their
    names: the signature names them."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        t = node.target
        args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a,
                                       (node.args, node.kwargs))
        if node.op in ("placeholder", "output"):
            name = node.name
        elif isinstance(t, torch._ops.OpOverload) and not _size_read(t):
            name = graph._target_to_str(t.overloadpacket.__name__)
            args, kwargs = _dispatched(t, args, kwargs)
        else:
            name = graph._target_to_str(t)
        new = graph.create_node(node.op, t, args, kwargs, name=name, type_expr=node.type)
        new.meta = dict(node.meta)
        if node.op == "placeholder":
            keep_name(new, node.name)
        env[node] = new
    return fx.GraphModule(gm, graph)


def _size_read(op: torch._ops.OpOverload) -> bool:
    return op._schema.name.split("::")[-1].startswith("sym_")


def _dispatched(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`args, kwargs` as the dispatcher hands `op` to Python, so as the re-trace records
    it: positional arguments by position less a tail at their defaults, keyword-only
    ones by name unless at their default. The capture's own insertions (the
    `_assert_tensor_metadata` of a `.to`) carry positional arguments as keywords."""
    params = op._schema.arguments
    if len(args) > len(params) or any(k not in {p.name for p in params} for k in kwargs):
        return args, kwargs  # not this schema's call: left as it is
    values = [args[i] if i < len(args) else kwargs.get(
        p.name, p.default_value if p.has_default_value() else _MISSING)
        for i, p in enumerate(params)]
    if any(v is _MISSING for v in values):
        return args, kwargs  # a required argument not given

    def at_default(i: int) -> bool:
        p = params[i]
        return p.has_default_value() and _same(values[i], p.default_value)

    first_kw = next((i for i, p in enumerate(params) if p.kwarg_only), len(params))
    end = first_kw
    while end > 0 and at_default(end - 1):
        end -= 1
    kw = {params[i].name: values[i] for i in range(first_kw, len(params)) if not at_default(i)}
    return tuple(values[:end]), kw


_MISSING = object()


def _same(a, b) -> bool:
    """Equal as the dispatcher's values compare: an int is not a float nor a bool."""
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def keep_name(placeholder: fx.Node, name: str) -> None:
    """The placeholder named as the signature names it. fx gives a new node `input_1`
    for `input` (it never shadows a builtin); export names nn.Sequential's argument
    `input` all the same, and sets the name directly as here."""
    placeholder.name = placeholder.target = name
