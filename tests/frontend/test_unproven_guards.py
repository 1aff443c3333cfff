"""Guards torch's solver cannot prove but that hold on every declared size
(frontend/unproven_guards.py): the model compiles at its dynamic dim and runs as eager;
a guard false for some size in range still refuses the Dim, as torch does."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch.utils._sympy.value_ranges import ValueRanges

import kiln
from kiln.errors import ShapeError
from kiln.frontend.unproven_guards import holds
from tests.helpers import rel_err


class MaxGuard(torch.nn.Module):
    """Branches on `max(T, 2T - 1) == 2T - 1`: true for every T >= 1, which torch 2.13
    cannot show (torch 2.11's `Min(128*T, 256*T)` from repeat_kv's reshape is the same
    kind)."""

    def forward(self, x):
        n = x.shape[0]
        if torch.sym_max(n, 2 * n - 1) == 2 * n - 1:
            return torch.relu(x) * 2
        return x - 1


class EvenProduct(torch.nn.Module):
    """Branches on `(T*T + T) % 2 == 0`: true for every T, shown only by trying each."""

    def forward(self, x):
        n = x.shape[0]
        if (n * n + n) % 2 == 0:
            return x.cumsum(0)
        return x


class EvenOnly(torch.nn.Module):
    """Reshapes T rows into pairs: false for an odd T."""

    def forward(self, x):
        return x.reshape(-1, 2, x.shape[-1]).sum(1)


@pytest.mark.parametrize("model", [MaxGuard(), EvenProduct()], ids=["max", "parity"])
def test_a_guard_true_on_every_declared_size_compiles(model):
    T = kiln.Dim("T", min=2, max=1024)
    exe = kiln.compile(model, (torch.randn(8, 4),), dynamic_shapes=({0: T},))
    for t in (2, 5, 300):
        x = torch.randn(t, 4)
        assert rel_err(exe(x), model(x)) <= 1e-6


def test_a_guard_false_for_some_size_still_refuses_the_dim():
    T = kiln.Dim("T", min=2, max=1024)
    with pytest.raises(ShapeError, match="do not hold") as err:
        kiln.compile(EvenOnly(), (torch.randn(8, 4),), dynamic_shapes=({0: T},))
    assert 'Dim "T"' in str(err.value)


def test_a_guard_only_an_enumeration_shows_is_refused_over_a_wide_range():
    """Too many sizes to try: kiln does not guess, torch's refusal stands."""
    T = kiln.Dim("T", min=2, max=1 << 20)
    with pytest.raises(ShapeError, match="do not hold"):
        kiln.compile(EvenProduct(), (torch.randn(8, 4),), dynamic_shapes=({0: T},))


def test_holds_over_ranges():
    s, u = sympy.Symbol("s0", integer=True), sympy.Symbol("s1", integer=True)
    r = {s: ValueRanges(2, 1024), u: ValueRanges(1, 8)}
    assert holds(sympy.Eq(sympy.Min(128 * s, 256 * s), 128 * s), r)
    assert holds(sympy.Eq(sympy.Max(s, 2 * s - 1), 2 * s - 1), r)
    assert holds(sympy.Ne(sympy.Min(128 * s, 512 * s), 4096 * s), r)  # torch 2.11's stride guards
    assert holds(sympy.Ge(4096 * s, sympy.Min(128 * s, 512 * s)), r)
    assert not holds(sympy.Ne(sympy.Min(128 * s, 512 * s), 256 * s - 256), r)
    assert holds(sympy.Le(s, 1024), r)
    assert not holds(sympy.Le(s, 1000), r)
    assert not holds(sympy.Eq(sympy.Mod(s, 2), 0), r)
    assert holds(sympy.Eq(sympy.Mod(s * s + s, 2), 0), r)
    assert holds(sympy.Ge(s * u, s), r)
    assert not holds(sympy.Ge(s, 3 * u), r)
    assert not holds(sympy.Ge(s, 2), {s: ValueRanges(2, sympy.oo)} | {})
    assert not holds(None, r)


def test_holds_reads_torchs_own_min_as_sympys():
    """torch 2.11's Min (torch.utils._sympy.functions) does not simplify by its
    arguments' signs; 2.13's does. A stand-in with its name and no simplification."""

    class Min(sympy.Function):  # noqa: D101 - torch 2.11's, as its guards hold it
        pass

    s = sympy.Symbol("s0", integer=True, positive=True)
    r = {s: ValueRanges(1, 8192)}  # too many sizes to try one by one
    assert holds(sympy.Ne(Min(128 * s, 512 * s), 4096 * s), r)
    assert holds(sympy.Eq(Min(128 * s, 512 * s), 128 * s), r)
    assert not holds(sympy.Eq(Min(128 * s, 512 * s), 512 * s), r)
