"""as_dim pins a SymInt to the one integer its symbols' export-time ranges allow, and
its cached answer follows those ranges when they narrow; bounds_of's cache follows the
bounds it is given."""

import sympy
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from kiln.ir.symbolic import as_dim


def _env_symbol(name: str):
    env = ShapeEnv()
    return env, env.create_symbol(8, source=ConstantSource(name),
                                  dynamic_dim=DimDynamic.DYNAMIC)


def test_a_dim_its_ranges_leave_one_value_is_that_int():
    env, s = _env_symbol("s")
    one = env.create_symintnode(1 - sympy.Max(0, 1 - s), hint=1)  # torch's slice of size 1
    assert as_dim(one) == 1 and isinstance(as_dim(one), int)
    free = env.create_symintnode(sympy.Min(s, 4), hint=4)
    assert as_dim(free) == sympy.Min(s, 4)


def test_the_answer_follows_narrowed_ranges():
    """torch's ShapeEnv version counter does not move when a range narrows: the cached
    answer is keyed by the ranges themselves."""
    env, s = _env_symbol("t")
    dim = env.create_symintnode(sympy.Min(s, 4), hint=4)
    assert as_dim(dim) == sympy.Min(s, 4)  # s >= 2: 2, 3 or 4
    env.constrain_symbol_range(s, compiler_min=4, compiler_max=64)
    assert as_dim(dim) == 4
    other_env, s2 = _env_symbol("t")  # the same expression in another env, wider again
    assert as_dim(other_env.create_symintnode(sympy.Min(s2, 4), hint=4)) == sympy.Min(s2, 4)


def test_bounds_of_follows_the_symbols_bounds_it_is_given():
    """bounds_of's cached answer is keyed by its symbols' Bounds: the same expression
    under other bounds (another compile's Dim) is bounded again."""
    from kiln.ir.symbolic import Bounds, bounds_of, symbol

    s = symbol("s0")
    assert bounds_of(2 * s + 1, {"s0": Bounds(1, 64)}) == Bounds(3, 129)
    assert bounds_of(2 * s + 1, {"s0": Bounds(4, None)}) == Bounds(9, None)
    assert bounds_of(2 * s + 1, {}) == Bounds(1, None)  # an unknown symbol: [0, inf)
