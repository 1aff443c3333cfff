"""Recognise a mask computed in attention's prologue as the causal mask.

A model that builds its mask from aranges (`j[None, :] <= i[:, None]`, or torch's
decomposed tril: `(j - i) <= 0` and-ed with a ones tensor) asks for exactly what
`is_causal` gives; recognised, the template skips the key blocks above the diagonal
instead of computing them and masking them out. The mask's ops are read as integer
forms in the query index i and key index j; the mask is causal when it reduces to
`j - i <= 0` (top-left aligned, as torch's is_causal). Anything else is not causal
and stays an ordinary mask, so a wrong answer here is impossible, only a missed one.
"""

from __future__ import annotations

import sympy

from kiln.ir.ops import ARANGES, RESHAPES, arange_start_step
from kiln.ir.plan import Ref, Region
from kiln.ir.symbolic import same_dim

QI, KJ = sympy.Symbol("qi", integer=True), sympy.Symbol("kj", integer=True)
# Views a ramp passes through on its way to the mask's [.., T, S] shape.
_VIEWS = RESHAPES | {"aten.unsqueeze.default", "aten.expand.default", "aten.alias.default"}
_CMP = {"le": "<=", "lt": "<", "ge": ">=", "gt": ">"}


def is_causal_mask(region: Region, name: str) -> bool:
    found = form(region, Ref(name))
    if not isinstance(found, tuple):
        return False
    return sympy.expand(found[1] - (KJ - QI)) == 0


def _ramp_index(shape) -> sympy.Symbol | None:
    """Which attention index (qi or kj) a ramp of this (right-aligned) shape varies with."""
    if shape is None or not shape:
        return None
    if len(shape) == 1 or same_dim(shape[-2], 1):
        return KJ if not same_dim(shape[-1], 1) else None
    return QI if same_dim(shape[-1], 1) else None


def form(region: Region, arg, sub=None):
    """An integer sympy form in qi / kj, a relation ("<=", lhs - rhs), True, or None.
    `sub(region, arg)`, where given, reads each operand instead (a reader that knows
    more values, calling back here for the ops it does not)."""
    read = sub or form
    if isinstance(arg, bool):
        return arg
    if isinstance(arg, int):
        return sympy.Integer(arg)
    if not isinstance(arg, Ref) or arg.name in region.inputs:
        return None
    op = region.op(arg.name)
    t = op.target
    if t in ARANGES:
        start, step = arange_start_step(op)
        if not (isinstance(start, int) and isinstance(step, int)):
            return None
        axis = _ramp_index(op.shape)
        return None if axis is None else start + step * axis
    if t in _VIEWS:
        inner = read(region, op.args[0])
        if isinstance(inner, sympy.Expr) and inner.free_symbols:
            src = region.op(op.args[0].name) if op.args[0].name not in region.inputs else None
            was = _ramp_index(src.shape) if src is not None else None
            now = _ramp_index(op.shape)
            if was is None or now is None:
                return None
            return inner.subs(was, now) if was != now else inner
        return inner
    if t == "aten.full.default" and op.args[1] is True:
        return True
    name = t.split(".")[1]
    if name in ("add", "sub") and len(op.args) == 2:
        x, y = read(region, op.args[0]), read(region, op.args[1])
        if not (isinstance(x, sympy.Expr) and isinstance(y, sympy.Expr)):
            return None
        return x + y if name == "add" else x - y
    if name in _CMP:
        x, y = read(region, op.args[0]), read(region, op.args[1])
        if not (isinstance(x, sympy.Expr) and isinstance(y, sympy.Expr)):
            return None
        cmp = _CMP[name]
        diff = x - y if cmp in ("<=", "<") else y - x
        return ("<=", diff + 1 if cmp in ("<", ">") else diff)  # integers: a < b is a+1 <= b
    if t == "aten.logical_and.default":
        x, y = read(region, op.args[0]), read(region, op.args[1])
        if x is True:
            return y
        if y is True:
            return x
    return None
