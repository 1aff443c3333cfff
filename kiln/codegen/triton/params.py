"""The runtime parameters of a template kernel, collected while its source is written.

Templates ask for a tensor pointer or a size while writing code and get back the
text to use: a constant size becomes a literal (so the compiler sees stride 1 and
static tile bounds), a symbolic one becomes an integer argument evaluated from the
bound symbols at launch. The result is the KernelSpec's `args` in parameter order.
"""

from __future__ import annotations

import sympy
import torch
from sympy.printing.str import StrPrinter

from kiln.codegen.triton.spec import KernelArg
from kiln.codegen.triton.strided import Strided
from kiln.ir.symbolic import Bounds, Dim, bounds_of

INT32_MAX = 2**31 - 1


class _KernelPrinter(StrPrinter):
    """Integer dim expressions as Triton code over the symbol arguments."""

    def _print_FloorDiv(self, e):
        return f"(({self._print(e.args[0])}) // ({self._print(e.args[1])}))"

    def _print_CeilDiv(self, e):
        return f"tl.cdiv({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_ModularIndexing(self, e):
        a, b, c = (self._print(x) for x in e.args)
        return f"((({a}) // ({b})) % ({c}))"

    def _print_Mod(self, e):
        return f"(({self._print(e.args[0])}) % ({self._print(e.args[1])}))"

    _print_PythonMod = _print_Mod

    def _print_Max(self, e):
        out = self._print(e.args[0])
        for a in e.args[1:]:
            out = f"tl.maximum({out}, {self._print(a)})"
        return out

    def _print_Min(self, e):
        out = self._print(e.args[0])
        for a in e.args[1:]:
            out = f"tl.minimum({out}, {self._print(a)})"
        return out

    def _print_Pow(self, e):
        if e.exp.is_Integer and e.exp > 0:
            return "(" + " * ".join([f"({self._print(e.base)})"] * int(e.exp)) + ")"
        raise ValueError(f"cannot write {e} as integer kernel code")

    _print_PowByNatural = _print_Pow


class _GridPrinter(_KernelPrinter):
    def _print_CeilDiv(self, e):
        return f"cdiv({self._print(e.args[0])}, {self._print(e.args[1])})"

    def _print_Max(self, e):
        return "max(" + ", ".join(self._print(a) for a in e.args) + ")"

    def _print_Min(self, e):
        return "min(" + ", ".join(self._print(a) for a in e.args) + ")"


class Params:
    def __init__(self, symbols: dict[str, Bounds]):
        self.symbols = symbols
        self.tensors: list[KernelArg] = []
        self.sizes: list[KernelArg] = []
        self._by_expr: dict[str, str] = {}
        self.needs_int64 = False

    def tensor(self, name: str, value: str, dtype: torch.dtype) -> str:
        for a in self.tensors:
            if a.value == value:
                return a.name
        self.tensors.append(KernelArg(name, "tensor", value=value, dtype=dtype))
        return name

    def size(self, expr: Dim) -> str:
        """Text for `expr` in kernel code: a literal, or arithmetic over symbol arguments.

        Sizes are written in terms of the model's symbols (`128 * s0`, not a fresh
        argument holding its value) so Triton's divisibility analysis sees that a
        stride is a multiple of 128 and can vectorise and pipeline the loads.
        """
        if isinstance(expr, int) or (isinstance(expr, sympy.Expr) and expr.is_Integer):
            return str(int(expr))
        for sym in sorted(expr.free_symbols, key=lambda x: x.name):
            if sym.name not in self._by_expr:
                self._by_expr[sym.name] = sym.name
                self.sizes.append(KernelArg(sym.name, "size", expr=sym))
                self.check_extent(sym)
        self.check_extent(expr)
        return "(" + _KernelPrinter().doprint(expr) + ")"

    def grid(self, expr: Dim) -> str:
        """`expr` as a launch-grid expression (plain Python over the same arguments)."""
        self.size(expr)
        return str(int(expr)) if isinstance(expr, int) else _GridPrinter().doprint(expr)

    def check_extent(self, expr: Dim) -> None:
        """Use 64-bit offsets when `expr` (a size or an element count) may pass int32."""
        hi = bounds_of(expr, self.symbols).hi
        if hi is None or hi > INT32_MAX:
            self.needs_int64 = True

    def args(self) -> list[KernelArg]:
        return self.tensors + self.sizes


def offset_code(params: Params, op: Strided, index: list[str]) -> str:
    """`offset + sum(index[d] * stride[d])` as kernel text, skipping zero strides."""
    terms = []
    if op.offset != 0:
        terms.append(params.size(op.offset))
    for ix, st in zip(index, op.strides):
        if ix is None or st == 0:
            continue
        if st == 1:
            terms.append(ix)
        else:
            terms.append(f"{ix} * {params.size(st)}")
    return " + ".join(terms) if terms else "0"


def extent(op: Strided) -> Dim:
    """One past the largest element offset `op` can touch (for the int64 decision)."""
    total: Dim = op.offset + 1
    for n, s in zip(op.shape, op.strides):
        total = total + (n - 1) * s
    return total
