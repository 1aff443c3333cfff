"""A model that returns None among its outputs (inside a tuple or list, as Llava's vision
tower output does) compiles; the module returns the None where eager does, also after
a save and load."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kiln


class SomeNone(nn.Module):
    def forward(self, x):
        return x * 2, None, [x.sum(-1), None, x + 1]


def _check(got, want):
    assert got[1] is None and got[2][1] is None and isinstance(got[2], list)
    for g, w in ((got[0], want[0]), (got[2][0], want[2][0]), (got[2][2], want[2][2])):
        assert torch.allclose(g, w)


@pytest.mark.parametrize("target", ["cpu", "interpret"])
def test_returned_nones_come_back_where_eager_has_them(target, tmp_path):
    model = SomeNone()
    exe = kiln.compile(model, (torch.randn(3, 4),), target=target)
    x = torch.randn(3, 4)
    _check(exe(x), model(x))
    exe.save(tmp_path / "m")
    _check(kiln.load(tmp_path / "m")(x), model(x))


def test_a_lone_none_output():
    class OneNone(nn.Module):
        def forward(self, x):
            return (None, x - 1)

    class OnlyNone(nn.Module):  # computes nothing: compiles to a module returning None,
        def forward(self, x):  # as eager and torch.compile return None
            return None

    exe = kiln.compile(OneNone(), (torch.randn(2),))
    got = exe(torch.ones(2))
    assert got[0] is None and torch.equal(got[1], torch.zeros(2))
    assert kiln.compile(OnlyNone(), (torch.randn(2),))(torch.ones(2)) is None
