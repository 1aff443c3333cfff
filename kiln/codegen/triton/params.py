"""The runtime parameters of a template kernel, collected while its source is written.

Templates (and the emitter writing their prologues and epilogues) ask for a tensor
pointer or a size while writing code and get back the text to use: a constant size
becomes a literal (so the compiler sees stride 1 and static tile bounds), a symbolic
one becomes code over the model's size symbols, passed as integer arguments and
evaluated from the bound symbols at launch.
"""

from __future__ import annotations

import sympy
import torch
from sympy.printing.str import StrPrinter

from kiln.codegen.triton.emit import KernelArgs
from kiln.codegen.triton.spec import KernelArg
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


class Params(KernelArgs):
    """The emitter's KernelArgs, with sizes written in terms of the model's symbols.

    A size becomes a literal or arithmetic over symbol arguments (`128 * s0`), not a
    fresh argument holding its value: Triton's divisibility analysis then sees that a
    stride is a multiple of 128 and can vectorise and pipeline the loads (with an
    opaque argument it must assume 2-byte alignment, and a flash-attention key loop
    loses its cp.async pipelining). Templates may name their pointers.
    """

    def __init__(self, symbols: dict[str, Bounds]):
        super().__init__()
        self.symbols = symbols
        self.needs_int64 = False

    def tensor(self, value: str, dtype: torch.dtype, shape=(), output: bool = False,
               name: str | None = None) -> str:
        if value not in self.tensors:
            kind = "out" if output else "in"
            n = sum(1 for v in self.tensors if (v in self.outputs) == output)
            self.tensors[value] = (name or f"{kind}_ptr{n}", dtype, tuple(shape))
            if output:
                self.outputs.add(value)
        return self.tensors[value][0]

    def dim(self, d: Dim) -> str:
        """`d` in kernel code: a literal, or arithmetic over the symbol arguments."""
        if isinstance(d, int) or (isinstance(d, sympy.Expr) and d.is_Integer):
            return str(int(d)) if int(d) >= 0 else f"({int(d)})"
        for sym in sorted(d.free_symbols, key=lambda x: x.name):
            if sym.name not in self.sizes:
                self.sizes[sym.name] = (sym.name, sym)
                self.check_extent(sym)
        self.check_extent(d)
        return "(" + _KernelPrinter().doprint(d) + ")"

    size = dim

    def grid(self, expr: Dim) -> str:
        """`expr` as a launch-grid expression (plain Python over the same arguments)."""
        self.dim(expr)
        return str(int(expr)) if isinstance(expr, int) else _GridPrinter().doprint(expr)

    def check_extent(self, expr: Dim) -> None:
        """Use 64-bit offsets when `expr` (a size or an element count) may pass int32."""
        hi = bounds_of(expr, self.symbols).hi
        if hi is None or hi > INT32_MAX:
            self.needs_int64 = True

    def args(self) -> list[KernelArg]:
        return self.kernel_args()
