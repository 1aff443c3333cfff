"""What a tensor built from aranges holds, as a formula in its element's index.

Not a pass. Masks and position ids are often computed, not read: `arange(T)`, shifted,
viewed, gathered by other aranges, compared. `IndexForms.of(node)` gives such a node's
value at index (..., x1, x0) as a sympy expression in the index symbols, counted from
the last dim (x0 is the last dim's index, so broadcasting needs no renaming): an
integer expression for integer tensors, a sympy boolean (a relation, True, False) for
boolean ones, None when the value is not followed (a float, an input, an op not
listed). A constant buffer that is a tril of ones (nanoGPT's `bias`, gpt-fast's
`causal`), read where its values are known, is the indicator of x0 <= x1: a float
tensor's form is only such a 0 / 1 indicator (exact in every float dtype). A unit dim's
symbol is pinned to 0. Every rule is exact; an op outside them
gives None, so a caller's decision made from a form is never wrong, only missed.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from kiln.graph.rewrite import name_of
from kiln.ir.graph import shape_of
from kiln.ir.ops import ARANGES, RESHAPES, arange_start_step, bind_args, norm_axis
from kiln.ir.symbolic import same_dim

MAX_RANK = 8
X = [sympy.Symbol(f"x{j}", integer=True, nonnegative=True) for j in range(MAX_RANK + 1)]
_ARITH = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
_CMP = {"le": sympy.Le, "lt": sympy.Lt, "ge": sympy.Ge, "gt": sympy.Gt,
        "eq": sympy.Eq, "ne": sympy.Ne}
_LOGIC = {"bitwise_and": sympy.And, "logical_and": sympy.And,
          "bitwise_or": sympy.Or, "logical_or": sympy.Or}
_SAME = {"aten.alias.default", "aten.clone.default", "aten.expand.default",
         "aten.detach.default"}
_FILLED = {"aten.full.default": 1, "aten.full_like.default": 1, "aten.new_full.default": 2}
_ONES = {"aten.ones.default", "aten.ones_like.default", "aten.new_ones.default"}
_ZEROS = {"aten.zeros.default", "aten.zeros_like.default", "aten.new_zeros.default"}


def _is_bool(form) -> bool:
    # a sympy Symbol is a Boolean atom too: an index symbol is an integer, never a truth
    return isinstance(form, sympy.logic.boolalg.Boolean) and not isinstance(form, sympy.Expr)


def _is_int(form) -> bool:
    return isinstance(form, sympy.Expr) and form.is_integer is True


def _shift(form, by: int, at: int = 0):
    """The form with the symbols of dims at position `at` and left of it moved `by`
    places left (dims inserted to their right: by > 0) or right (dims removed)."""
    return form.xreplace({X[j]: X[j + by] for j in range(at, MAX_RANK + 1 - max(by, 0))})


def _indicator(form):
    """(condition) when a form takes only the values 1 (where the condition holds) and 0."""
    if isinstance(form, sympy.Piecewise) and len(form.args) == 2 \
            and form.args[0].expr == 1 and form.args[1] == (0, True):
        return form.args[0].cond
    if form in (sympy.Integer(0), sympy.Integer(1)):
        return sympy.true if form == 1 else sympy.false
    return None


def _compare(cmp, x, y):
    """cmp(x, y) of integer forms; an indicator against a constant by its two values."""
    for a, b, flip in ((x, y, False), (y, x, True)):
        cond = _indicator(a) if isinstance(a, sympy.Piecewise) else None
        if cond is not None and not b.free_symbols:
            one, zero = (cmp(b, 1), cmp(b, 0)) if flip else (cmp(1, b), cmp(0, b))
            return sympy.Or(sympy.And(cond, one), sympy.And(sympy.Not(cond), zero))
    if isinstance(x, sympy.Piecewise) or isinstance(y, sympy.Piecewise):
        return None
    return cmp(x, y)


def tril_indicator(t: torch.Tensor):
    """x0 <= x1 (bool) or its 0 / 1 indicator when `t` is tril(ones(R, C)) in its last
    two dims (any before them unit); None otherwise."""
    if t.dim() < 2 or any(d != 1 for d in t.shape[:-2]):  # the last two dims: x1, x0
        return None
    m = t.reshape(t.shape[-2:])
    if m.device.type == "meta" or m.numel() > (1 << 24):
        return None
    want = torch.ones(m.shape, dtype=torch.bool).tril()
    if not torch.equal(m.detach().cpu() != 0, want) or not bool(((m == 0) | (m == 1)).all()):
        return None
    keep = sympy.Le(X[0], X[1])
    return keep if t.dtype == torch.bool else sympy.Piecewise((1, keep), (0, True))


class IndexForms:
    """The forms of one graph's nodes (memoised: a mask's ops are shared by layers)."""

    def __init__(self, consts: dict | None = None):
        self._memo: dict[fx.Node, object] = {}
        self._consts = consts or {}  # placeholders whose values are known (fold_constants)
        self.read: set[fx.Node] = set()  # those whose values a form was read from

    def of(self, arg):
        if isinstance(arg, bool):
            return sympy.true if arg else sympy.false
        if isinstance(arg, int):
            return sympy.Integer(arg)
        if not isinstance(arg, fx.Node) or not isinstance(arg.meta.get("val"), torch.Tensor):
            return None
        if arg not in self._memo:
            self._memo[arg] = self._pinned(arg, self._form(arg))
        return self._memo[arg]

    @staticmethod
    def _pinned(node: fx.Node, form):
        shape = shape_of(node)
        if form is None or len(shape) > MAX_RANK:
            return None
        form = form.xreplace({X[len(shape) - 1 - i]: sympy.Integer(0)
                              for i, d in enumerate(shape) if same_dim(d, 1)})
        dtype = node.meta["val"].dtype
        if dtype == torch.bool:
            return form if _is_bool(form) else None
        if dtype.is_complex:
            return None
        if dtype.is_floating_point:
            return form if _indicator(form) is not None else None
        return form if _is_int(form) else None

    def _form(self, node: fx.Node):
        if node in self._consts:
            self.read.add(node)
            return tril_indicator(self._consts[node])
        name = name_of(node)
        if not name:
            return None
        op = name.split(".")[1]
        a = node.args
        if name in ARANGES:
            start, step = arange_start_step(node)
            if isinstance(start, int) and isinstance(step, int):
                return sympy.Integer(start) + step * X[0]
            return None
        if name in _SAME or name == "aten._to_copy.default":
            return self._cast(node, self.of(a[0]))
        if name in _FILLED:
            value = a[_FILLED[name]]
            return self.of(value) if isinstance(value, (bool, int)) else None
        if name in _ONES or name in _ZEROS:
            one = name in _ONES
            if node.meta["val"].dtype == torch.bool:
                return sympy.true if one else sympy.false
            return sympy.Integer(int(one))
        if op in _ARITH and len(a) == 2:
            x, y = self.of(a[0]), self.of(a[1])
            if not (_is_int(x) and _is_int(y)) or node.kwargs.get("alpha", 1) != 1:
                return None
            return _ARITH[op](x, y)
        if name == "aten.neg.default":
            x = self.of(a[0])
            return -x if _is_int(x) else None
        if op in _CMP:
            x, y = self.of(a[0]), self.of(a[1])
            return _compare(_CMP[op], x, y) if _is_int(x) and _is_int(y) else None
        if op in _LOGIC:
            x, y = self.of(a[0]), self.of(a[1])
            return _LOGIC[op](x, y) if _is_bool(x) and _is_bool(y) else None
        if op in ("logical_not", "bitwise_not"):
            x = self.of(a[0])
            return sympy.Not(x) if _is_bool(x) else None
        if name == "aten.where.self":
            cond = self.of(a[0])
            return self.of(a[1]) if cond is sympy.true else (
                self.of(a[2]) if cond is sympy.false else None)
        rules = {"aten.unsqueeze.default": self._unsqueeze, "aten.slice.Tensor": self._slice,
                 "aten.select.int": self._select, "aten.permute.default": self._permute,
                 "aten.cat.default": self._cat, "aten.cumsum.default": self._cumsum,
                 "aten.index.Tensor": self._index}
        if name in rules:
            return rules[name](node)
        if name in RESHAPES or name.startswith("aten.squeeze"):
            return self._unit_reshape(node)
        return None

    def _cast(self, node: fx.Node, x):
        if x is None:
            return None
        to = node.meta["val"].dtype
        if to == torch.bool and _is_int(x):
            return _compare(sympy.Ne, x, sympy.Integer(0))
        if to != torch.bool and _is_bool(x):
            if x in (sympy.true, sympy.false):
                return sympy.Integer(int(x is sympy.true))
            return sympy.Piecewise((1, x), (0, True))
        return x

    def _unsqueeze(self, node: fx.Node):
        x = self.of(node.args[0])
        if x is None:
            return None
        out_rank = len(shape_of(node))
        pos = out_rank - 1 - norm_axis(node.args[1], out_rank)  # the new dim, from the right
        return _shift(x, 1, pos)

    def _unit_reshape(self, node: fx.Node):
        """A reshape that only adds or drops unit dims: the other dims keep their order."""
        src = node.args[0]
        x = self.of(src)
        if x is None:
            return None
        ins = [i for i, d in enumerate(reversed(shape_of(src))) if not same_dim(d, 1)]
        outs = [i for i, d in enumerate(reversed(shape_of(node))) if not same_dim(d, 1)]
        s_in = [d for d in reversed(shape_of(src)) if not same_dim(d, 1)]
        s_out = [d for d in reversed(shape_of(node)) if not same_dim(d, 1)]
        if len(s_in) != len(s_out) or not all(same_dim(p, q) for p, q in zip(s_in, s_out)):
            return None
        return x.xreplace({X[i]: X[o] for i, o in zip(ins, outs)})

    @staticmethod
    def _axis(tensor: fx.Node, dim) -> int:
        """`dim` of `tensor` as a position from the right."""
        r = len(shape_of(tensor))
        return r - 1 - norm_axis(dim, r)

    def _slice(self, node: fx.Node):
        b = bind_args(node)
        x = self.of(b["self"])
        start, step = b["start"] if b["start"] is not None else 0, b["step"]
        if x is None or not isinstance(start, int) or start < 0 or not isinstance(step, int):
            return None
        p = self._axis(b["self"], b["dim"])
        return x.xreplace({X[p]: sympy.Integer(start) + step * X[p]})

    def _select(self, node: fx.Node):
        x, index = self.of(node.args[0]), node.args[2]
        if x is None or not isinstance(index, int) or index < 0:
            return None
        p = self._axis(node.args[0], node.args[1])
        return _shift(x.xreplace({X[p]: sympy.Integer(index)}), -1, p + 1)

    def _permute(self, node: fx.Node):
        x = self.of(node.args[0])
        if x is None:
            return None
        r = len(shape_of(node))
        perm = [norm_axis(d, r) for d in node.args[1]]
        return x.xreplace({X[r - 1 - src]: X[r - 1 - i] for i, src in enumerate(perm)})

    def _cat(self, node: fx.Node):
        """One formula when each piece continues it (position ids with a prepended
        `first - 1`, as torch.diff's prepend decomposes)."""
        b = bind_args(node)
        pieces = b["tensors"]
        forms = [self.of(t) for t in pieces]
        if any(not _is_int(f) for f in forms):
            return None
        p = self._axis(node, b["dim"])  # the pieces' rank is the output's
        sizes = [shape_of(t)[len(shape_of(t)) - 1 - p] for t in pieces]
        offsets = [sum(sizes[:k], sympy.Integer(0)) for k in range(len(pieces))]
        for m, f in enumerate(forms):
            whole = f.xreplace({X[p]: X[p] - offsets[m]})
            if all(sympy.expand(self._at(whole, X[p] + o, same_dim(s, 1), p) - g) == 0
                   for g, o, s in zip(forms, offsets, sizes)):
                return whole
        return None

    @staticmethod
    def _at(form, where, unit: bool, p: int):
        at = form.xreplace({X[p]: where})
        return at.xreplace({X[p]: sympy.Integer(0)}) if unit else at

    def _cumsum(self, node: fx.Node):
        x = self._cast_to_int(self.of(node.args[0]))
        if x is None or x.free_symbols:
            return None
        return x * (X[self._axis(node, node.args[1])] + 1)  # the input's rank

    @staticmethod
    def _cast_to_int(x):
        if _is_bool(x):
            return sympy.Integer(1) if x is sympy.true else (
                sympy.Integer(0) if x is sympy.false else None)
        return x if _is_int(x) else None

    def _index(self, node: fx.Node):
        """x[i0, i1, ...] with index tensors for x's leading dims: x's form with those
        dims' symbols replaced by the indices' forms, placed left of x's other dims."""
        x, indices = self.of(node.args[0]), node.args[1]
        if x is None or not indices or any(i is None for i in indices):
            return None
        idx = [self.of(i) for i in indices]
        # a negative index reads from the end (x[-1] is the last row): only indices
        # provably >= 0 are read as the formula says
        if any(not _is_int(f) or f.is_nonnegative is not True for f in idx):
            return None
        r = len(shape_of(node.args[0]))
        rest = r - len(indices)
        return x.xreplace({X[r - 1 - k]: _shift(f, rest) for k, f in enumerate(idx)})
