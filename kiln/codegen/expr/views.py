"""View ops as index maps: which element of its source a view's element reads.

`source_index(op, index, shape_of)` answers, for a view op inside a region, "element
`index` of this view is element `j` of value `src`" without moving data. Reshapes
(`view` means a logical row-major reshape in kiln), permutes, expands, squeezes,
slices with a step, selects and the pieces of split/unbind are supported; a view kiln
cannot express (diagonal, unfold, view_as_real) raises CodegenUnsupported, and the
region runs extern.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.codegen.expr.indexing import Dim, Index, Lin, broadcast_index, norm, reshape_index
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.ir.ops import RESHAPES, SPLITS, SQUEEZES, UNIT_DIM_OPS, bind_args, norm_axis
from kiln.ir.plan import Op, Ref, Sym
from kiln.ir.symbolic import same_dim

VIEW_TARGETS = RESHAPES | UNIT_DIM_OPS | SPLITS | {
    "aten.alias.default", "aten.permute.default", "aten.transpose.int", "aten.t.default",
    "aten.expand.default", "aten.slice.Tensor", "aten.select.int", "getitem",
}


def dim_value(x) -> Dim:
    """A size argument of an op (an int or a Sym) as a Dim."""
    if isinstance(x, Sym):
        return norm(x.expr)
    if isinstance(x, bool) or not isinstance(x, int):
        raise CodegenUnsupported(f"size argument {x!r} is not an integer")
    return x


def is_view(op: Op, ops: dict[str, Op]) -> bool:
    if op.target == "getitem":
        src = op.args[0]
        return isinstance(src, Ref) and src.name in ops and ops[src.name].target in SPLITS
    return op.target in VIEW_TARGETS


def source_index(op: Op, index: Index, shape_of: Callable[[str], tuple],
                 ops: dict[str, Op]) -> tuple[str, Index]:
    """(source value, its index) read by element `index` of view op `op`."""
    t = op.target
    if t == "getitem":
        return _split_piece(ops[op.args[0].name], op.args[1], index, shape_of)
    src = op.args[0].name
    shape, out = tuple(shape_of(src)), tuple(op.shape)
    rank = len(shape)
    if t in RESHAPES:
        return src, reshape_index(index, out, shape)
    if t == "aten.alias.default":
        return src, index
    if t == "aten.permute.default":
        dims = [norm_axis(d, rank) for d in op.args[1]]
        res: list[Lin | None] = [None] * rank
        for i, d in enumerate(dims):
            res[d] = index[i]
        return src, tuple(res)
    if t in ("aten.transpose.int", "aten.t.default"):
        d0, d1 = (op.args[1], op.args[2]) if t == "aten.transpose.int" else (0, 1)
        if rank < 2:
            return src, index
        d0, d1 = norm_axis(d0, rank), norm_axis(d1, rank)
        res = list(index)
        res[d0], res[d1] = index[d1], index[d0]
        return src, tuple(res)
    if t == "aten.expand.default":
        return src, broadcast_index(index, out, shape)
    if t == "aten.unsqueeze.default":
        d = norm_axis(op.args[1], rank + 1)
        return src, tuple(index[:d] + index[d + 1:])
    if t in SQUEEZES:
        return src, _unsqueeze_back(op, index, shape)
    if t == "aten.slice.Tensor":
        return src, _slice(op, index, shape)
    if t == "aten.select.int":
        a = bind_args(op)
        d = norm_axis(a["dim"], rank)
        i = select_index(a["index"], shape[d])
        return src, tuple(index[:d]) + (Lin.of(i),) + tuple(index[d:])
    raise CodegenUnsupported(f"view {t} has no index map in kiln's Triton codegen")


def _unsqueeze_back(op: Op, index: Index, shape: tuple) -> Index:
    rank = len(shape)
    if op.target == "aten.squeeze.default":
        dims = set(range(rank))
    elif op.target == "aten.squeeze.dim":
        dims = {norm_axis(op.args[1], rank)}
    else:
        dims = {norm_axis(d, rank) for d in op.args[1]}
    removed = [d for d in range(rank) if d in dims and same_dim(shape[d], 1)]
    res, k = [], 0
    for d in range(rank):
        if d in removed:
            res.append(Lin())
        else:
            res.append(index[k])
            k += 1
    return tuple(res)


def select_index(i, size: Dim) -> Dim:
    """A select's index argument in 0..size-1 (a negative one counts from the end)."""
    i = dim_value(i)
    if isinstance(i, int) and i < 0:
        i = norm(i + size)
    return i


def slice_bounds(a: dict, size: Dim, length: Dim | None = None) -> tuple[Dim, Dim, Dim]:
    """A slice's (start, end, step) from its bound arguments (`bind_args`), normalised
    like Python's: None and negative ends; a symbolic start that may be negative
    (`x[-t:]` with a dynamic t) through the slice's `length` (_symbolic_start)."""
    start, end, step = a["start"], a["end"], a["step"]
    out = []
    for v, default in ((start, 0), (end, size)):
        v = default if v is None else dim_value(v)
        if isinstance(v, int):
            if v < 0:
                v = v + size if isinstance(size, int) else norm(v + size)
            if isinstance(v, int) and isinstance(size, int):
                v = min(max(v, 0), size)
            elif isinstance(v, int) and v >= 2**62:  # "to the end" sentinel
                v = size
        out.append(v)
    start = out[0]
    if not isinstance(start, int) and not start.is_nonnegative:
        start = _symbolic_start(a, size, length, dim_value(step))
    return start, out[1], dim_value(step)


def _slice(op: Op, index: Index, shape: tuple) -> Index:
    a = bind_args(op)
    d = norm_axis(a["dim"], len(shape))
    start, _, step = slice_bounds(a, shape[d], op.shape[d])
    res = list(index)
    res[d] = Lin.of(start) + index[d] * step
    return tuple(res)


def _symbolic_start(a: dict, size: Dim, length: Dim | None, step) -> Dim:
    """A symbolic start that may be negative (`x[-t:]` with a dynamic t) counts from the
    end and clamps at 0, as Python's: for a step-1 slice to the end that is the size
    less the slice's length (export's shapes already clamp); any other declines."""
    end = a["end"]
    to_end = end is None or (isinstance(end, int) and end >= 2**62) or \
        same_dim(dim_value(end), size)
    if step == 1 and to_end and length is not None:
        return norm(size - length)
    raise CodegenUnsupported(f"a slice from {a['start']} (a symbolic start that may be "
                             "negative) with an end or step kiln cannot normalise")


def _split_piece(tup: Op, k: int, index: Index, shape_of) -> tuple[str, Index]:
    a = bind_args(tup)
    src = a["self"].name
    shape = tuple(shape_of(src))
    d = norm_axis(a["dim"], len(shape))
    if tup.target == "aten.unbind.int":
        return src, tuple(index[:d]) + (Lin.of(k),) + tuple(index[d:])
    if tup.target == "aten.split_with_sizes.default":
        start: Dim = 0
        for s in a["split_sizes"][:k]:
            start = norm(start + dim_value(s))
    else:
        start = norm(dim_value(a["split_size"]) * k)
    res = list(index)
    res[d] = index[d] + start
    return src, tuple(res)
