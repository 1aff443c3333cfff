"""Tools the graph passes share: matching nodes, comparing symbolic shapes, rewriting.

Not a pass. Shapes are compared symbolically (a dim is an int or a sympy expression);
a question about sizes that needs more than equality asks the bounds analysis and
answers "not provable" when a bound is missing, so callers fall back instead of failing.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import sympy
import torch
import torch.fx as fx

from kiln.ir.graph import KilnGraph, infer_meta, shape_of
from kiln.ir.ops import RESHAPES, STRICT_VIEWS, OpCategory, category, op_name
from kiln.ir.symbolic import Bounds, Dim, as_dim, bounds_of, same_dim

aten = torch.ops.aten



def name_of(node) -> str:
    """The op name of a call node ('aten.mul.Tensor', 'getitem'), '' for anything else."""
    if isinstance(node, fx.Node) and node.op == "call_function":
        return op_name(node.target)
    return ""


def is_op(node, *names: str) -> bool:
    return name_of(node) in names


def category_of(node) -> OpCategory | None:
    return category(name_of(node)) if name_of(node) else None


def is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def is_sym(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.SymInt)


def dtype(node: fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def rank(node: fx.Node) -> int:
    return node.meta["val"].dim()


def same_shape(a, b) -> bool:
    """Equal shapes; `a` and `b` are nodes or shape tuples."""
    sa = shape_of(a) if isinstance(a, fx.Node) else tuple(a)
    sb = shape_of(b) if isinstance(b, fx.Node) else tuple(b)
    return len(sa) == len(sb) and all(same_dim(x, y) for x, y in zip(sa, sb))


def provably_le(a: Dim, b: Dim, symbols: Mapping[str, Bounds]) -> bool:
    """Is a <= b for every allowed value of the symbols? False when it cannot be shown.

    Exact algebra first (b - a with positive symbols), then interval bounds: a's upper
    bound against b's lower bound. An unbounded `a` (upper bound None) is "not provable".
    """
    if same_dim(a, b):
        return True
    diff = sympy.simplify(sympy.sympify(b) - sympy.sympify(a))
    if diff.is_nonnegative:
        return True
    if diff.is_negative:
        return False
    hi = bounds_of(a, symbols).hi
    return hi is not None and hi <= bounds_of(b, symbols).lo


def is_unit(d: Dim, symbols: Mapping[str, Bounds]) -> bool:
    """Is the dim 1 at every allowed size?"""
    return d == 1 if isinstance(d, int) else bounds_of(d, symbols) == Bounds(1, 1)


def insert(kg: KilnGraph, before: fx.Node, target, args, kwargs=None,
           like: fx.Node | None = None, val=None) -> fx.Node:
    """Insert `target(*args, **kwargs)` before `before`, with meta and `like`'s stack trace.
    `val`: its fake value, given where running the op on fake inputs fails (CUDA's SDPA
    picks a kernel that pads to concrete sizes)."""
    with kg.graph.inserting_before(before):
        node = kg.graph.create_node("call_function", target, tuple(args), dict(kwargs or {}),
                                    name=_short_name(target))
    if like is not None and "stack_trace" in like.meta:
        node.meta["stack_trace"] = like.meta["stack_trace"]
    # a view's meta is made directly (a contiguous value of the new shape): a fake `view`
    # of a non-contiguous value fails, and in kiln's value semantics a view is a reshape.
    if val is not None:
        node.meta["val"] = val
    elif op_name(target) in STRICT_VIEWS:
        node.meta["val"] = _view_meta(kg, args[0].meta["val"], [_meta_arg(a) for a in args[1]])
    else:
        infer_meta(kg, node)
    return node


def _view_meta(kg: KilnGraph, src, sizes):
    """A view's fake value, made without running view/reshape: their checks compare
    symbolic sizes, which could add guards that specialise a dynamic dim."""
    infer = [isinstance(s, int) and s == -1 for s in sizes]
    if any(infer):
        known = 1
        for s, unknown in zip(sizes, infer):
            known = known if unknown else known * s
        sizes = [src.numel() // known if unknown else s for s, unknown in zip(sizes, infer)]
    with kg.fake_mode():
        return src.new_empty(sizes)


def _short_name(target) -> str:
    """'view' for aten.view.default, 'mul' for operator.mul: FX numbers repeats."""
    return getattr(target, "_opname", None) or getattr(target, "__name__", "op")


def _meta_arg(a):
    return a.meta["val"] if isinstance(a, fx.Node) else a


def replace(node: fx.Node, new: fx.Node) -> None:
    """Make every user of `node` read `new` instead, and drop `node`."""
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


def erase_if_dead(node) -> None:
    """Erase `node` and then any of its inputs left unused (call nodes only)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if (isinstance(n, fx.Node) and n.op == "call_function" and not n._erased
                and not n.users):
            inputs = list(n.all_input_nodes)
            n.graph.erase_node(n)
            stack.extend(inputs)


def dim_arg(kg: KilnGraph, d: Dim, before: fx.Node):
    """A dim as an FX argument placed before `before`: an int, or a SymInt-valued node.

    Reuses an existing size node computing `d`; otherwise reads the size from a
    placeholder that has it (placeholders precede every node), or builds `d` from
    the sizes of its parts. Returns None if `d` cannot be built (callers keep the graph
    as it was).
    """
    d = as_dim(d)
    if isinstance(d, int):
        return d
    for n in kg.graph.nodes:
        if n is before:
            break
        if is_sym(n) and same_dim(as_dim(n.meta["val"]), d):
            return n
    for p in kg.graph.nodes:
        if p.op != "placeholder":
            break
        if is_tensor(p):
            for i, pd in enumerate(shape_of(p)):
                if same_dim(pd, d):
                    return insert(kg, before, aten.sym_size.int, (p, i))
    combine = {sympy.Add: operator.add, sympy.Mul: operator.mul}.get(type(d))
    if combine is None:
        return None
    parts = [dim_arg(kg, a, before) if not a.is_Integer else int(a) for a in d.args]
    if any(p is None for p in parts):
        return None
    out = parts[0]
    for p in parts[1:]:
        out = insert(kg, before, combine, (out, p))
    return out


def shape_args(kg: KilnGraph, shape, before: fx.Node) -> list | None:
    """A shape as an FX argument list (see dim_arg); None if a dim cannot be built."""
    out = [dim_arg(kg, d, before) for d in shape]
    return None if any(a is None for a in out) else out


def reshape_sizes(kg: KilnGraph, node: fx.Node) -> list | None:
    """Size arguments for a view to the shape of the reshape `node`, valid at `node`.

    Reuses `node`'s own sizes when it has them (view / reshape), else builds them
    (unsqueeze / squeeze). None when a symbolic size cannot be built.
    """
    if name_of(node) in RESHAPES:
        return list(node.args[1])
    return shape_args(kg, shape_of(node), node)


def reshape_to(kg: KilnGraph, src: fx.Node, node: fx.Node, sizes=None) -> fx.Node | None:
    """A view of `src` to the shape of the reshape `node`, placed at `node`."""
    sizes = reshape_sizes(kg, node) if sizes is None else sizes
    if sizes is None:
        return None
    return insert(kg, node, aten.view.default, (src, sizes), like=node)


def strip(node, *names: str):
    """Follow the first argument through ops named `names` (e.g. casts), return the source."""
    while name_of(node) in names:
        node = node.args[0]
    return node


def scalar_arg(node: fx.Node, i: int):
    """The i-th argument if it is a Python number, else None."""
    a = node.args[i] if len(node.args) > i else None
    return a if isinstance(a, (int, float)) and not isinstance(a, bool) else None
