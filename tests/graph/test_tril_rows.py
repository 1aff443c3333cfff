"""Mask rows gathered from a constant causal buffer (gpt-fast's `causal[None, None,
input_pos]`) as the comparison they hold (graph/tril_rows.py): the gather and the buffer
leave the graph, the attention's mask passes a prefix of the keys a row (no mask loops),
and the output is eager's under Triton's interpreter, a negative position (torch reads
the buffer's last row) included; buffers that are not a tril of ones stay gathers."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from tests.codegen.test_attention_envelope import StaticCache
from tests.helpers import rel_err

T = torch.export.Dim("T", min=1, max=96)
S = 150


def _args(start: int, t: int, pos=None):
    pos = torch.arange(start, start + t) if pos is None else pos
    return (torch.randn(1, 4, t, 16), torch.randn(1, 2, S, 16), torch.randn(1, 2, S, 16), pos)


def _gathers(kg) -> int:
    return sum(str(n.target) == "aten.index.Tensor" for n in kg.graph.nodes)


def test_the_gather_becomes_a_comparison_and_the_buffer_is_not_read():
    kg = kiln.compile(StaticCache(S), _args(0, 8), dynamic_shapes=({2: T}, None, None, {0: T}),
                      compile_to="graph")
    assert _gathers(kg) == 0
    (buf,) = [n for n in kg.graph.nodes if n.op == "placeholder" and "causal" in n.name]
    assert not buf.users


def test_prefill_chunk_decode_and_a_negative_position_match_eager():
    model = StaticCache(S)
    exe = kiln.compile(model, _args(0, 8), dynamic_shapes=({2: T}, None, None, {0: T}),
                       target="interpret")
    (attn,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert attn.key_bounds and attn.key_bounds[2] is None  # every tile plain
    source = exe.program.kplan.kernels[attn.name].spec.source
    assert "if not plain" not in source
    cases = [_args(0, 40), _args(37, 20), _args(140, 1),
             _args(0, 5, torch.tensor([3, -1, 0, 7, -150]))]  # -1: the last row; -S: row 0
    for args in cases:
        assert rel_err(exe(*args), model(*args)) <= 1e-5, args[3]


class Buffered(torch.nn.Module):
    def __init__(self, buf):
        super().__init__()
        self.register_buffer("mask", buf)

    def forward(self, q, k, v, input_pos):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[None, None, input_pos],
                                              enable_gqa=True)


def _holed():
    m = torch.ones(S, S, dtype=torch.bool).tril()
    m[40, 3] = False
    return m


@pytest.mark.parametrize("buf", [torch.ones(S, S, dtype=torch.bool).triu(), _holed(),
                                 torch.ones(S, S).tril()], ids=["triu", "holed", "float"])
def test_a_buffer_that_is_no_tril_of_ones_stays_a_gather(buf):
    kg = kiln.compile(Buffered(buf), _args(0, 8), dynamic_shapes=({2: T}, None, None, {0: T}),
                      compile_to="graph")
    assert _gathers(kg) == 1
