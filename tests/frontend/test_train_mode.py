"""A model left in train mode is refused where that mode changes what it computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ArgumentError


def _net(p=0.5):
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 4))


def test_active_dropout_in_train_mode_is_refused_naming_the_module():
    with pytest.raises(ArgumentError) as e:
        kiln.compile(_net(), (torch.randn(2, 8),))
    msg = str(e.value)
    assert "train mode" in msg and "1 (Dropout p=0.5 is active)" in msg
    assert "model.eval()" in msg and "no autograd" in msg and "allow_train=True" in msg


def test_batch_statistics_and_rnn_dropout_are_named():
    model = nn.ModuleDict({"bn": nn.BatchNorm1d(4), "rnn": nn.LSTM(4, 4, 2, dropout=0.2)})

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = model

        def forward(self, x):
            return self.parts["rnn"](self.parts["bn"](x).unsqueeze(0))[0]

    with pytest.raises(ArgumentError) as e:
        kiln.compile(Both(), (torch.randn(3, 4),))
    assert "parts.bn (BatchNorm1d uses batch statistics)" in str(e.value)
    assert "parts.rnn (LSTM dropout=0.2 is active)" in str(e.value)


def test_eval_mode_or_inert_train_mode_compiles():
    x = torch.randn(2, 8)
    model = _net().eval()
    torch.testing.assert_close(kiln.compile(model, (x,))(x), model(x))
    inert = _net(p=0.0)  # train mode, but dropout with p=0 computes the same
    torch.testing.assert_close(kiln.compile(inert, (x,))(x), inert(x))


def test_opting_in_compiles_the_train_mode_graph():
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    x = torch.randn(6, 4)
    exe = kiln.compile(bn, (x,), allow_train=True)
    with torch.no_grad():
        ref = bn(x)  # batch statistics, as in train mode
    torch.testing.assert_close(exe(x), ref, rtol=1e-5, atol=1e-5)
