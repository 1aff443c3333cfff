"""The printers of dim expressions: manifest text, run-time Python, kernel and grid code.

Kernel sources are hashed for caches and compared by tests, and compile_expr's code
runs on every call: the strings below pin each printer's output, so a change to the
shared printer base shows up here first.
"""

import pytest
import sympy
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils._sympy import functions as tfn

from kiln.codegen.expr.kernel_args import SymbolicArgs, _GridPrinter, _KernelPrinter
from kiln.ir.symbolic import Bounds, compile_expr, parse, same_dim, symbol, to_str

s0, s1 = symbol("s0"), symbol("s1")

# name -> (expression, manifest text, Python over env, Triton kernel code, launch grid)
CASES = {
    "floordiv": (tfn.FloorDiv(s0 + 1, 128), "FloorDiv(s0 + 1, 128)",
                 "((env['s0'] + 1)//128)", "((s0 + 1)//128)", "((s0 + 1)//128)"),
    # CeilDiv(a, constant) is built as a FloorDiv ...
    "ceildiv": (tfn.CeilDiv(s0, 4), "FloorDiv(s0 + 3, 4)",
                "((env['s0'] + 3)//4)", "((s0 + 3)//4)", "((s0 + 3)//4)"),
    # ... so an unevaluated CeilDiv is made by hand to reach each printer's spelling.
    "ceildiv_node": (sympy.Function.__new__(tfn.CeilDiv, s0, 4), "CeilDiv(s0, 4)",
                     "(-((-(env['s0'])) // (4)))", "tl.cdiv(s0, 4)", "cdiv(s0, 4)"),
    "modular_indexing": (tfn.ModularIndexing(s0, 2, 64), "ModularIndexing(s0, 2, 64)",
                         "(((env['s0']) // (2)) % (64))", "(((s0) // (2)) % (64))",
                         "(((s0) // (2)) % (64))"),
    "mod": (tfn.Mod(s0, 3), "Mod(s0, 3)", "((env['s0']) % (3))", "((s0) % (3))",
            "((s0) % (3))"),
    "python_mod": (tfn.PythonMod(s0, 7), "PythonMod(s0, 7)", "((env['s0']) % (7))",
                   "((s0) % (7))", "((s0) % (7))"),
    "max": (tfn.Max(s0, 4), "Max(4, s0)", "max(4, env['s0'])", "tl.maximum(4, s0)",
            "max(4, s0)"),
    "min3": (tfn.Min(s0, s1, 16), "Min(16, s0, s1)", "min(16, env['s0'], env['s1'])",
             "tl.minimum(tl.minimum(16, s0), s1)", "min(16, s0, s1)"),
    "pow": (s0**2, "s0**2", "((env['s0']) ** (2))", "((s0) * (s0))", "((s0) * (s0))"),
    "pow_by_natural": (tfn.PowByNatural(s0, 3), "s0**3", "((env['s0']) ** (3))",
                       "((s0) * (s0) * (s0))", "((s0) * (s0) * (s0))"),
    "product": (128 * s0, "128*s0", "128*env['s0']", "128*s0", "128*s0"),
    "products": (4096 * s0 * s1 + 2 * s1 - 1, "4096*s0*s1 + 2*s1 - 1",
                 "4096*env['s0']*env['s1'] + 2*env['s1'] - 1", "4096*s0*s1 + 2*s1 - 1",
                 "4096*s0*s1 + 2*s1 - 1"),
    "negative_term": (s0 - 64 * s1, "s0 - 64*s1", "env['s0'] - 64*env['s1']", "s0 - 64*s1",
                      "s0 - 64*s1"),
    "nested": (tfn.CeilDiv(tfn.Max(s0, 8) * 64, tfn.FloorDiv(s1, 2)),
               "FloorDiv((FloorDiv(s1, 2)) + 64*Max(8, s0) - 1, FloorDiv(s1, 2))",
               "((((env['s1']//2)) + 64*max(8, env['s0']) - 1)//((env['s1']//2)))",
               "((((s1//2)) + 64*tl.maximum(8, s0) - 1)//((s1//2)))",
               "((((s1//2)) + 64*max(8, s0) - 1)//((s1//2)))"),
    "symbol": (s1, "s1", "env['s1']", "s1", "s1"),
}
ENV = {"s0": 37, "s1": 6}


@pytest.mark.parametrize("name", list(CASES))
def test_each_printer_writes_the_pinned_text(name):
    expr, text, python, kernel, grid = CASES[name]
    assert to_str(expr) == text
    assert compile_expr(expr).__doc__ == python
    assert _KernelPrinter().doprint(expr) == kernel
    assert _GridPrinter().doprint(expr) == grid


@pytest.mark.parametrize("name", list(CASES))
def test_python_code_computes_the_value_and_text_parses_back(name):
    expr = CASES[name][0]
    want = int(expr.subs({s0: ENV["s0"], s1: ENV["s1"]}))
    assert compile_expr(expr)(ENV) == want
    assert compile_expr(parse(to_str(expr)))(ENV) == want


def test_an_int_arguments_symbol_parses_back_as_torch_made_it():
    """torch makes an int argument's symbol an integer that may be 0, not positive."""
    s = symbol("s2", positive=False)
    expr = tfn.Max(1, s)
    assert parse(to_str(expr), frozenset({"s2"})) == expr
    assert compile_expr(parse(to_str(expr), frozenset({"s2"})))({"s2": 0}) == 1
    assert parse(to_str(expr)) == symbol("s2")  # read as a tensor dim's: Max(1, s) is s


def test_symbolic_args_wrap_kernel_code_and_print_grids_with_the_grid_printer():
    args = SymbolicArgs({"s0": Bounds(1, 4096), "s1": Bounds(1, 64)})
    expr = tfn.Max(s0, 4) * 2
    assert args.dim(expr) == "(" + _KernelPrinter().doprint(expr) + ")"
    assert args.grid(expr) == _GridPrinter().doprint(expr)
    assert set(args.sizes) == {"s0"}


def test_kernel_code_has_no_spelling_for_a_negative_power():
    with pytest.raises(ValueError):
        _KernelPrinter().doprint(sympy.Pow(s0, -1, evaluate=False))


def test_same_dim_compares_ints_exprs_and_unexpanded_forms():
    assert same_dim(3, 3) and not same_dim(3, 4)
    assert same_dim(sympy.Integer(4), 4)
    assert same_dim(2 * (s0 + 1), 2 * s0 + 2)
    assert same_dim(s0 * (s0 + 1) - s0**2 - s0 + 5, 5)  # an expr that expands to a constant
    assert not same_dim(s0, 1)
    assert not same_dim(s0, s1)


def test_same_dim_reads_torch_symints():
    x = ShapeEnv().create_symintnode(s0, hint=5)
    assert same_dim(x * 2, 2 * s0)
    assert not same_dim(x, 5)  # a dynamic dim never equals its example size
