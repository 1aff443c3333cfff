"""Index maps: symbolic index expressions evaluate to the offsets numpy computes, and
contiguous accesses simplify back to the flat index (what lets Triton vectorise)."""

import itertools
import random

import numpy as np
import pytest

from kiln.codegen.expr.indexing import (
    Lin,
    Var,
    delinearize,
    floordiv,
    linearize,
    may_exceed_int32,
    modidx,
    reshape_index,
)
from kiln.ir.symbolic import Bounds, symbol


def evaluate(lin: Lin, env: dict) -> int:
    code = lin.code(lambda d: f"({d})")
    return eval(code, {}, env)  # noqa: S307 - test of generated index code


S0, S1 = symbol("s0"), symbol("s1")


@pytest.mark.parametrize("shape", [(2, 3, 4), (S0, 16), (1, S0, 2, 8), (S1, 1, S0), (5,)])
def test_flat_index_round_trips_to_itself(shape):
    n = 1
    for d in shape:
        n = n * d
    x = Var("x", n)
    assert linearize(delinearize(x, shape), shape).equals(Lin.of(x))


def _concrete(shape, env):
    return tuple(d if isinstance(d, int) else int(d.subs({S0: env["s0"], S1: env["s1"]}))
                 for d in shape)


def _factorizations(total: int) -> list[tuple[int, ...]]:
    out = []
    for k in (1, 2, 3):
        for combo in itertools.product(range(1, total + 1), repeat=k):
            if int(np.prod(combo)) == total:
                out.append(combo)
    return out


def test_reshape_index_matches_numpy_for_every_element():
    random.seed(0)
    shapes = _factorizations(24)
    for _ in range(60):
        src, dst = random.choice(shapes), random.choice(shapes)
        x = Var("x", 24)
        idx = reshape_index(delinearize(x, dst), dst, src)
        for p in range(24):
            got = tuple(evaluate(i, {"x": p}) for i in idx)
            assert got == np.unravel_index(p, src), (src, dst, p)


@pytest.mark.parametrize("src,dst", [((1, S0, 32), (1, S0, 2, 16)), ((S0, 64), (1, S0, 64)),
                                     ((S0, S1), (S0 * S1,)), ((2, S0, 3), (2 * S0, 3))])
def test_symbolic_reshape_index(src, dst):
    env = {"s0": 3, "s1": 5}
    n = int(np.prod(_concrete(dst, env)))
    x = Var("x", n)
    idx = reshape_index(delinearize(x, dst), dst, src)
    for p in range(n):
        got = tuple(evaluate(i, {**env, "x": p}) for i in idx)
        assert got == np.unravel_index(p, _concrete(src, env))


def test_permuted_view_offsets_match_numpy():
    """The KV-cache write's source: [s, 32] -> [1, s, 2, 16] -> permute -> [1, 2, s, 16]."""
    s = 5
    x = Var("x", 32 * S0)
    i = delinearize(x, (1, 2, S0, 16))
    src = (i[0], i[2], i[1], i[3])
    off = linearize(reshape_index(reshape_index(src, (1, S0, 2, 16), (1, S0, 32)),
                                  (1, S0, 32), (S0, 32)), (S0, 32))
    ref = np.arange(s * 32).reshape(1, s, 2, 16).transpose(0, 2, 1, 3).reshape(-1)
    assert [evaluate(off, {"x": p, "s0": s}) for p in range(32 * s)] == list(ref)


def test_simplification_rules():
    x = Var("x", 64)
    assert floordiv(Lin.of(x) * 16 + 3, 16).equals(Lin.of(x))
    assert modidx(Lin.of(x) * 8 + Lin.of(Var("y", 8)), 1, 8).equals(Lin.of(Var("y", 8)))
    assert floordiv(floordiv(x, 4), 2).equals(floordiv(x, 8))
    assert modidx(x, 1, 64).equals(Lin.of(x))  # x < 64 already
    y = Var("y", S0 * 16)
    assert (floordiv(y, 16) * 16 + modidx(y, 1, 16)).equals(Lin.of(y))


def test_int64_indexing_decided_by_bounds():
    syms = {"s0": Bounds(1, 4096), "s1": Bounds(1, None)}
    assert not may_exceed_int32([S0 * 4096, 128256 * 4096], syms)
    assert may_exceed_int32([S0 * 4096 * 1024], syms)
    assert may_exceed_int32([S1 * 2], syms)  # no upper bound: may exceed
