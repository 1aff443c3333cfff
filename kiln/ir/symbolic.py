"""Symbolic dims with value bounds.

A dim is an int or a sympy expression over the model's dynamic-dim symbols (s0, s1,
...). Every symbol carries `Bounds` from the export's Dim(min=, max=); bounds of any
expression follow by interval arithmetic. An upper bound of None means unbounded: a
pass that needs a bound must fall back (mask, loop), never fail.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import sympy
from sympy.printing.str import StrPrinter
from torch.utils._sympy import functions as tfn
from torch.utils._sympy.value_ranges import ValueRanges, bound_sympy

Dim = int | sympy.Expr


@dataclass(frozen=True)
class Bounds:
    lo: int
    hi: int | None  # None: no upper bound

    def __str__(self) -> str:
        return f"[{self.lo}, {'inf' if self.hi is None else self.hi}]"

    def contains(self, v: int) -> bool:
        return v >= self.lo and (self.hi is None or v <= self.hi)

    def to_json(self) -> dict:
        return {"min": self.lo, "max": self.hi}

    @staticmethod
    def from_json(d: Mapping) -> Bounds:
        return Bounds(int(d["min"]), None if d["max"] is None else int(d["max"]))


def symbol(name: str, positive: bool = True) -> sympy.Symbol:
    """A size symbol with torch's assumptions, so parsed expressions equal the ones
    torch produced: a tensor dim's symbol is a positive integer, an int argument's
    (`positive=False`) only an integer, as it may be 0 (`Max(1, s)` must stay)."""
    return sympy.Symbol(name, integer=True, positive=True) if positive \
        else sympy.Symbol(name, integer=True)


def as_dim(x) -> Dim:
    """A torch SymInt / sympy expr / int as a kiln Dim (an int whenever it is constant,
    a SymInt's also where its symbols' ranges leave it one value: torch's slicing makes
    `1 - Max(0, 1 - s)` for a slice of a size-1 dim, which is 1 for every s >= 1, and
    a dim kiln took for s-sized would not broadcast)."""
    if hasattr(x, "node") and hasattr(x.node, "expr"):  # torch.SymInt
        x = _pinned(x.node.expr, getattr(x.node, "shape_env", None))
    if isinstance(x, sympy.Expr):
        return int(x) if x.is_Integer else x
    return int(x)


def _pinned(expr, shape_env):
    """`expr`, or the one integer its export-time ranges allow."""
    if shape_env is None or not isinstance(expr, sympy.Expr) or expr.is_Integer \
            or expr.is_Symbol:
        return expr
    try:
        ranges = tuple(sorted(((x, shape_env.var_to_range.get(x))
                               for x in expr.free_symbols), key=lambda xr: xr[0].name))
        return _pinned_in(expr, ranges)
    except Exception:  # a shape env that cannot bound it: keep the expression
        return expr


@functools.lru_cache(maxsize=8192)
def _pinned_in(expr, ranges):
    """_pinned's answer from its symbols' ranges (what torch's ShapeEnv.bound_sympy
    reads), cached: the passes and the verifier ask for the same few expressions of
    every layer's shapes ~100K times a compile (an 8B LLM's compile-only build spent
    ~2 s of its ~20 s bounding them again)."""
    vr = bound_sympy(expr, dict(ranges))
    lo, hi = vr.lower, vr.upper
    return int(lo) if lo == hi and getattr(lo, "is_Integer", False) else expr


def same_dim(a, b) -> bool:
    """Are two dims (ints, sympy exprs, SymInts) equal for every value of the symbols?"""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    a, b = as_dim(a), as_dim(b)  # constants become ints
    if a == b:
        return True
    if isinstance(a, int) and isinstance(b, int):
        return False
    return sympy.expand(a - b) == 0


def is_static(d: Dim) -> bool:
    return isinstance(d, int)


def numel(shape) -> Dim:
    n: Dim = 1
    for d in shape:
        n = n * d
    return as_dim(n) if not isinstance(n, int) else n


def bounds_of(expr: Dim, symbols: Mapping[str, Bounds]) -> Bounds:
    """Interval bounds of a dim expression given each symbol's bounds."""
    if isinstance(expr, int):
        return Bounds(expr, expr)
    known = sorted(((s, symbols.get(s.name)) for s in expr.free_symbols),
                   key=lambda sb: sb[0].name)
    return _bounds_in(expr, tuple(known))


@functools.lru_cache(maxsize=8192)
def _bounds_in(expr, bounds: tuple) -> Bounds:
    """bounds_of from its symbols' Bounds (None: unknown), cached: templates ask for the
    same few sizes of every layer's regions."""
    ranges = {s: ValueRanges(0, sympy.oo) if b is None else
              ValueRanges(b.lo, sympy.oo if b.hi is None else b.hi) for s, b in bounds}
    vr = bound_sympy(expr, ranges)
    lo = int(vr.lower) if vr.lower.is_Integer else 0
    hi = int(vr.upper) if vr.upper.is_Integer else None
    return Bounds(lo, hi)


def upper_bound(expr: Dim, symbols: Mapping[str, Bounds]) -> int | None:
    return bounds_of(expr, symbols).hi


def evaluate(expr: Dim, env: Mapping[str, int]) -> int:
    if isinstance(expr, int):
        return expr
    return compile_expr(expr)(env)


class _Printer(StrPrinter):
    """Prints torch's integer functions by name so `parse` reads them back exactly.

    Not an `IntArithPrinter`: its job is a round trip by name (`FloorDiv(a, b)`,
    `Max(a, b)`), not code that computes the value.
    """

    def _print(self, expr, **kwargs):
        # FloorDiv prints itself as `a//b` (its own _sympystr wins over _print_FloorDiv),
        # which sympify reads back as floor(a/b): a different expression.
        if isinstance(expr, tfn.FloorDiv):
            return self._print_FloorDiv(expr)
        return super()._print(expr, **kwargs)

    def _print_FloorDiv(self, e):
        return f"FloorDiv({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_CeilDiv(self, e):
        return f"CeilDiv({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_ModularIndexing(self, e):
        return "ModularIndexing(" + ", ".join(self._print(a) for a in e.args) + ")"

    def _print_PythonMod(self, e):
        return f"PythonMod({self._print(e.args[0])}, {self._print(e.args[1])})"


class IntArithPrinter(StrPrinter):
    """A dim expression as integer arithmetic code (Python, a launch grid, Triton).

    torch's integer functions become `//`, `%` and calls; a language says only how it
    spells what differs, through the hooks `ceil_div`, `extremum` and `power` (and
    `_print_Symbol` for how a symbol is read). FloorDiv prints itself (torch's
    `_sympystr`: `(a//b)`, operands through this printer), so it has no hook.
    """

    def ceil_div(self, a: str, b: str) -> str:
        return f"(-((-({a})) // ({b})))"

    def extremum(self, fn: str, args: list[str]) -> str:
        """`fn` is "max" or "min"."""
        return f"{fn}(" + ", ".join(args) + ")"

    def power(self, base: str, exp) -> str:
        """base ** exp for a sympy exponent: a product, so only natural exponents."""
        if exp.is_Integer and exp > 0:
            return "(" + " * ".join([f"({base})"] * int(exp)) + ")"
        raise ValueError(f"cannot write {base} ** {exp} as integer code")

    def _print_CeilDiv(self, e):
        return self.ceil_div(self._print(e.args[0]), self._print(e.args[1]))

    def _print_ModularIndexing(self, e):
        a, b, c = (self._print(x) for x in e.args)
        return f"((({a}) // ({b})) % ({c}))"

    def _print_Mod(self, e):
        return f"(({self._print(e.args[0])}) % ({self._print(e.args[1])}))"

    _print_PythonMod = _print_Mod

    def _print_Max(self, e):
        return self.extremum("max", [self._print(a) for a in e.args])

    def _print_Min(self, e):
        return self.extremum("min", [self._print(a) for a in e.args])

    def _print_Pow(self, e):
        return self.power(self._print(e.args[0]), e.args[1])

    _print_PowByNatural = _print_Pow


class _PyPrinter(IntArithPrinter):
    """Python integer arithmetic over a dict `env` (compile_expr's code)."""

    def _print_Symbol(self, e):
        return f"env[{e.name!r}]"

    def power(self, base: str, exp) -> str:
        return f"(({base}) ** ({self._print(exp)}))"

    def _print_Rational(self, e):
        return f"({e.p} / {e.q})"


def to_str(expr: Dim) -> str:
    """Exact text form of a dim, for manifests and IR dumps; `parse` inverts it."""
    return str(expr) if isinstance(expr, int) else _Printer().doprint(expr)


_PARSE_FUNCS = {
    "FloorDiv": tfn.FloorDiv,
    "CeilDiv": tfn.CeilDiv,
    "ModularIndexing": tfn.ModularIndexing,
    "PythonMod": tfn.PythonMod,
    "Mod": tfn.Mod,
    "Max": tfn.Max,
    "Min": tfn.Min,
}


@functools.lru_cache(maxsize=4096)
def parse(text: str, int_args: frozenset[str] = frozenset()) -> Dim:
    """`to_str`'s text back as the dim. `int_args` names the symbols of dynamic int
    arguments (plan.size_args), which torch made integers but not positive."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    expr = sympy.sympify(text, locals=dict(_PARSE_FUNCS))
    expr = expr.subs({s: symbol(s.name, s.name not in int_args) for s in expr.free_symbols})
    return as_dim(expr)


def python_int_code(expr: sympy.Expr) -> str:
    """A dim expression as Python source reading the sizes from a dict `env`."""
    code = _PyPrinter().doprint(expr)
    return code if isinstance(expr, sympy.Symbol) else f"int({code})"


@functools.lru_cache(maxsize=4096)
def compile_expr(expr: sympy.Expr):
    """A fast callable env -> int for a dim expression (used on every call at run time)."""
    code = _PyPrinter().doprint(expr)
    fn = eval(f"lambda env: int({code})", {"max": max, "min": min})  # noqa: S307
    fn.__doc__ = code
    return fn


def shape_str(shape) -> str:
    return "[" + ", ".join(to_str(d) for d in shape) + "]"
