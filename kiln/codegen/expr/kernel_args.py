"""A kernel's parameters, collected while its source is written.

`KernelArgs` hands out a parameter for each tensor and size the code asks for (the
generators' flat kernels pass each distinct size as one `ks<n>` argument).
`SymbolicArgs` is for templates: they (and the emitter writing their prologues and
epilogues) ask for a tensor pointer or a size while writing code and get back the text
to use: a constant size becomes a literal (so the compiler sees stride 1 and static
tile bounds), a symbolic one becomes code over the model's size symbols, passed as
integer arguments and evaluated from the bound symbols at launch.
"""

from __future__ import annotations

import sympy
import torch

from kiln.codegen.build.spec import KernelArg
from kiln.ir.symbolic import Bounds, Dim, IntArithPrinter, bounds_of, shape_str, to_str

INT32_MAX = 2**31 - 1


class KernelArgs:
    """The kernel's parameters, created as the code asks for them."""

    def __init__(self):
        self.tensors: dict[str, tuple[str, torch.dtype, tuple]] = {}  # value -> (param, ...)
        self.outputs: set[str] = set()
        self.sizes: dict[str, tuple[str, Dim]] = {}  # printed dim -> (param, dim)
        self.blocks: dict[str, tuple] = {}  # value -> its TMA descriptor's block

    def tensor(self, value: str, dtype: torch.dtype, shape=(), output: bool = False) -> str:
        if value not in self.tensors:
            kind = "out" if output else "in"
            n = sum(1 for v in self.tensors if (v in self.outputs) == output)
            self.tensors[value] = (f"{kind}_ptr{n}", dtype, tuple(shape))
            if output:
                self.outputs.add(value)
        return self.tensors[value][0]

    def dim(self, d: Dim) -> str:
        """A size in code: an int literal, or the size parameter carrying it.

        A constant factor stays in the code (`4096 * ks0`, not a parameter equal to
        4096*s0): Triton then knows the size's divisibility and can vectorise masked
        accesses whose bound it is.
        """
        if isinstance(d, int):
            return str(d) if d >= 0 else f"({d})"
        coeff, rest = d.as_coeff_Mul()
        if coeff.is_Integer and coeff not in (1, -1) and not rest.is_Number:
            return f"({int(coeff)} * {self.dim(rest)})"
        key = to_str(d)
        if key not in self.sizes:
            self.sizes[key] = (f"ks{len(self.sizes)}", d)
        return self.sizes[key][0]

    def kernel_args(self) -> list[KernelArg]:
        out = [KernelArg(p, "tensor", value=v, dtype=dt, block=self.blocks.get(v))
               for v, (p, dt, _) in self.tensors.items()]
        out += [KernelArg(p, "size", expr=d) for p, d in self.sizes.values()]
        return out

    def names(self) -> list[str]:
        """The parameter names, in the kernel signature's order."""
        return [a.name for a in self.kernel_args()]

    def describe(self) -> list[str]:
        """Comment lines saying what each parameter is (dtype and symbolic shape)."""
        lines = []
        for p, dt, shape in self.tensors.values():
            lines.append(f"# {p}: {str(dt).replace('torch.', '')}{shape_str(shape)}")
        for p, d in self.sizes.values():
            lines.append(f"# {p} = {to_str(d)}")
        return lines


class _KernelPrinter(IntArithPrinter):
    """Integer dim expressions as Triton code over the symbol arguments."""

    def ceil_div(self, a: str, b: str) -> str:
        return f"tl.cdiv({a}, {b})"

    def extremum(self, fn: str, args: list[str]) -> str:
        call = {"max": "tl.maximum", "min": "tl.minimum"}[fn]  # two operands each
        out = args[0]
        for a in args[1:]:
            out = f"{call}({out}, {a})"
        return out


class _GridPrinter(IntArithPrinter):
    """Integer dim expressions as launch-grid Python (`cdiv` is in the grid's scope)."""

    def ceil_div(self, a: str, b: str) -> str:
        return f"cdiv({a}, {b})"


class SymbolicArgs(KernelArgs):
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

    def descriptor(self, value: str, dtype: torch.dtype, shape, block: tuple) -> str:
        """A TMA descriptor over input `value`'s [-1, last dim] view, loaded in `block`s
        (ints or tunable names; spec.KernelArg): its parameter, for `.load([row, col])`."""
        if value in self.tensors and self.blocks.get(value) != tuple(block):
            raise ValueError(f"{value} is already a kernel argument of another form")
        self.blocks[value] = tuple(block)
        return self.tensor(value, dtype, shape, name=f"desc{len(self.blocks) - 1}")

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
