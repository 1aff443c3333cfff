"""A learned position table read at arange(T): a Dim past its rows is refused at compile
time (eager raises IndexError there; generated kernels would read past the table)."""

import pytest
import torch
from torch import nn

import kiln
from kiln.errors import ShapeError


class Positions(nn.Module):
    """GPT-2's `wpe(arange(T))`, shifted as OPT's and BART's learned positions are."""

    def __init__(self, rows=8, shift=0):
        super().__init__()
        self.wpe, self.shift = nn.Embedding(rows, 4), shift

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0) + self.shift
        return x + self.wpe(pos)


@pytest.mark.parametrize("shift", [0, 2])
def test_a_dim_past_the_table_is_refused_with_the_max_that_fits(shift):
    x = torch.randn(2, 5, 4)
    seq = kiln.Dim("seq", min=2, max=16)
    with pytest.raises(ShapeError) as e:
        kiln.compile(Positions(shift=shift), (x,), dynamic_shapes=({1: seq},))
    msg = str(e.value)
    assert "wpe.weight (8 rows)" in msg and 'dim "seq"' in msg
    assert f"max={8 - shift} or less" in msg and "test_position_tables.py" in msg


def test_a_dim_within_the_table_compiles():
    model = Positions()
    exe = kiln.compile(model, (torch.randn(2, 5, 4),),
                       dynamic_shapes=({1: kiln.Dim("seq", min=2, max=8)},))
    x = torch.randn(2, 8, 4)
    torch.testing.assert_close(exe(x), model(x))


class SlicedPositions(nn.Module):
    """BERT's and DistilBERT's form: a position buffer sliced to the length, which
    torch.export's constraint check refuses itself."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.randn(1, 8, 4))

    def forward(self, x):
        return x + self.pos[:, :x.shape[1]]


def test_a_sliced_table_names_the_dim_torch_refused():
    x = torch.randn(2, 5, 4)
    with pytest.raises(ShapeError) as e:
        kiln.compile(SlicedPositions(), (x,),
                     dynamic_shapes=({1: kiln.Dim("seq", min=2, max=16)},))
    assert e.value.where == 'dim 1 of x (Dim "seq")'
    assert "max=8" in e.value.hint
