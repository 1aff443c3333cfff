"""Cutting a pipeline call into micro-batches: which inputs are cut, how outputs join,
and the clear errors for cuts that cannot be right (in one process; the runs on gloo
are in test_pp_runs.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import kiln
from kiln.errors import ArgumentError, ShapeError
from kiln.runtime.micro_batches import plan_micro_batches

B = torch.export.Dim("batch", min=1, max=8)
T = torch.export.Dim("seq", min=1, max=16)


class _Head(nn.Module):
    """[B, T, 8] rows and a shared [T] offset in; [B, T, 4] out (and, with `last`,
    the last position's [B, 4], which has no T)."""

    def __init__(self, last: bool = False):
        super().__init__()
        self.proj, self.last = nn.Linear(8, 4), last

    def forward(self, x, offset):
        y = self.proj(x) + offset[:, None]
        return (y, y[:, -1]) if self.last else y


@pytest.fixture(scope="module")
def plans():
    x, offset = torch.randn(2, 3, 8), torch.randn(3)
    dyn = ({0: B, 1: T}, {0: T})
    return {  # the dispatch plans: the micro-batch cut reads no kernel
        "head": kiln.compile(_Head(), (x, offset), dynamic_shapes=dyn, compile_to="dispatch"),
        "last": kiln.compile(_Head(last=True), (x, offset), dynamic_shapes=dyn,
                             compile_to="dispatch"),
        "static": kiln.compile(_Head(), (x, offset), compile_to="dispatch"),
    }


def test_a_batch_cut_cuts_the_rows_and_shares_the_rest(plans):
    micro = plan_micro_batches(plans["head"], 2)
    assert micro.cut == (0, None) and micro.join == (0,) and micro.slots == 2
    x, offset = torch.randn(4, 3, 8), torch.randn(3)
    pieces = micro.pieces([x, offset])
    assert [tuple(p[0].shape) for p in pieces] == [(2, 3, 8), (2, 3, 8)]
    assert all(p[1] is offset for p in pieces)
    assert torch.equal(micro.joined([[p[0]] for p in pieces])[0], x)
    seq = plan_micro_batches(plans["head"], 2, dim="seq")  # a named dim: T and offset
    assert seq.cut == (1, 0) and seq.join == (1,)


@pytest.mark.parametrize("count,split,dim,error,match", [
    (0, "batch", None, ArgumentError, "positive int"),
    (True, "batch", None, ArgumentError, "positive int"),
    (2, "diagonal", None, ArgumentError, "not one of batch, sequence"),
    (2, "batch", "rows", ArgumentError, "no dynamic dim named 'rows'"),
    (2, "sequence", None, ArgumentError, "needs a KV cache"),
])
def test_bad_micro_batches_are_clear_errors(plans, count, split, dim, error, match):
    with pytest.raises(error, match=match):
        plan_micro_batches(plans["head"], count, split, dim)


def test_a_cut_the_outputs_or_the_signature_cannot_take_is_refused(plans):
    with pytest.raises(ShapeError, match="output 1 .* has no dim \"seq\""):
        plan_micro_batches(plans["last"], 2, dim="seq")
    with pytest.raises(ShapeError, match="compiled with it static"):
        plan_micro_batches(plans["static"], 2)


def test_a_batch_m_does_not_divide_is_refused(plans):
    micro = plan_micro_batches(plans["head"], 2)
    with pytest.raises(ShapeError, match="batch of 3 rows .* cannot be cut into 2 equal"):
        micro.pieces([torch.randn(3, 3, 8), torch.randn(3)])


def test_micro_batches_need_pipeline_stages():
    module = kiln.compile(nn.Linear(8, 4), (torch.randn(2, 8),), target="cpu")
    with pytest.raises(ArgumentError, match="pipeline-parallel"):
        module.micro_batches(2)
