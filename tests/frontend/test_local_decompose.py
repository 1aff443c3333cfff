"""Node-by-node decomposition (frontend/local_decompose.py) gives torch's re-trace's
program, and leaves programs it cannot be sure of to that re-trace."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import kiln
from kiln.frontend import export
from kiln.frontend.local_decompose import ShapesSpecialised, decompose_locally


@pytest.fixture(autouse=True)
def _local(monkeypatch):
    """The node-by-node pass (the default), whatever the environment running the tests
    asks (KILN_DECOMPOSE=retrace turns it off)."""
    monkeypatch.setenv("KILN_DECOMPOSE", "local")


class CacheBlock(torch.nn.Module):
    """Linear layers, a chunked SwiGLU, a KV-cache write in place, SDPA over the cache."""

    def __init__(self):
        super().__init__()
        self.wqkv = torch.nn.Linear(16, 48, bias=False)
        self.w13 = torch.nn.Linear(16, 64, bias=False)
        self.w2 = torch.nn.Linear(32, 16, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, 2, 12, 8))

    def forward(self, x, pos):
        q, k, v = self.wqkv(x).split(16, dim=-1)
        q = q.view(1, -1, 2, 8).transpose(1, 2)
        k = k.view(1, -1, 2, 8).transpose(1, 2)
        self.k_cache.index_copy_(2, pos, k)
        att = F.scaled_dot_product_attention(q, self.k_cache, self.k_cache)
        gate, up = self.w13(x).chunk(2, dim=-1)
        return att.transpose(1, 2).flatten(2) + self.w2(F.silu(gate) * up)


def _exported(model, t=5):
    x, pos = torch.randn(1, t, 16), torch.arange(t)
    seq = Dim("seq", min=2, max=12)
    return export.capture(model, (x, pos), dynamic_shapes=({1: seq}, {0: seq}))


def _ops(ep):
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def test_same_program_as_torchs_retrace():
    ep = _exported(CacheBlock().eval())
    local = decompose_locally(ep, _table())  # this program is plain enough
    assert local is not None
    ref = ep.run_decompositions(_table())
    assert Counter(_ops(local)) == Counter(_ops(ref))
    assert not {"aten.linear.default", "aten.index_copy_.default"} & set(_ops(local))
    specs = [(s.kind.name, s.target) for s in local.graph_signature.output_specs]
    assert specs == [(s.kind.name, s.target) for s in ref.graph_signature.output_specs]
    assert specs[0] == ("BUFFER_MUTATION", "k_cache")


def test_compiled_matches_eager_with_cache_writes():
    model = CacheBlock().eval()
    exe = kiln.compile(model, (torch.randn(1, 5, 16), torch.arange(5)),
                       dynamic_shapes=({1: Dim("seq", min=2, max=12)},
                                       {0: Dim("seq", min=2, max=12)}))
    eager = CacheBlock().eval()
    eager.load_state_dict(model.state_dict())
    for t in (3, 7):
        x, pos = torch.randn(1, t, 16), torch.arange(t)
        ref = eager(x, pos)
        out = exe(x, pos)
        assert (out - ref).norm() / ref.norm() < 1e-5


class ViewBeforeWrite(torch.nn.Module):
    """A view of the buffer taken before it is written: eager reads the new values
    through it, which only functionalization (torch's re-trace) keeps."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 3))

    def forward(self, x):
        row = self.buf[0]
        self.buf.add_(x)
        return row * 2


def test_view_read_after_a_write_is_left_to_torch():
    model = ViewBeforeWrite().eval()
    ep = export.capture(model, (torch.randn(4, 3),))
    assert decompose_locally(ep, _table()) is None
    x = torch.randn(4, 3)
    exe = kiln.compile(ViewBeforeWrite().eval(), (torch.randn(4, 3),))
    assert torch.allclose(exe(x), model(x))


def _guarding_linear(x, w, b=None):
    """A linear decomposition that reads the batch size as a number (as torch 2.11's
    C++ linear did outside the Python dispatcher): tracing it pins the dynamic dim."""
    rows = int(x.shape[0]) * x.shape[1]
    out = torch.mm(x.reshape(rows, x.shape[-1]), w.t()).reshape(*x.shape[:-1], w.shape[0])
    return out if b is None else out + b


def _exported_batch(model):
    x, pos = torch.randn(2, 5, 16), torch.arange(5)
    batch, seq = Dim("batch", min=1, max=4), Dim("seq", min=2, max=12)
    return (x, pos), ({0: batch, 1: seq}, {0: seq})


class Linear2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(16, 8)

    def forward(self, x, pos):
        return self.w(x) + pos[None, :, None]


def test_a_trace_that_pins_a_dynamic_size_is_refused_and_the_model_recaptured():
    """The pass must not leave the captured program narrowed: it raises, and the import
    captures again, so the re-trace still sees the dynamic batch."""
    model = Linear2().eval()
    args, dyn = _exported_batch(model)
    table = dict(_table())
    table.pop(torch.ops.aten.linear.default, None)
    table[torch.ops.aten.linear.default] = _guarding_linear
    ep = export.capture(model, args, dynamic_shapes=dyn)
    with pytest.raises(ShapesSpecialised):
        decompose_locally(ep, table)
    fresh = export.capture(model, args, dynamic_shapes=dyn)
    out = export.decompose(fresh, recapture=lambda: export.capture(model, args,
                                                                  dynamic_shapes=dyn))
    ranges = sorted((int(r.lower), int(r.upper)) for r in out.range_constraints.values())
    assert (1, 4) in ranges  # the batch is still dynamic


def _table():
    return export.kiln_table()


class CountedWrite(torch.nn.Module):
    """transformers' StaticCache bookkeeping: a counter set from the positions through
    copy_, advanced through the no-op `to` of that copy_'s result, read after."""

    def __init__(self):
        super().__init__()
        self.register_buffer("counter", torch.tensor(0, dtype=torch.int64))
        self.register_buffer("cache", torch.zeros(12, 16))

    def forward(self, x, pos):
        c = self.counter.copy_(pos[0])
        at = torch.arange(x.shape[0]) + c
        c.to(torch.int64).add_(x.shape[0])
        self.cache.index_copy_(0, at, x)
        return self.cache.sum(0) * self.counter


def test_writes_through_a_written_buffers_aliases_decompose_node_by_node():
    """In-place ops on copy_'s result and on a `to` that changes nothing write the
    buffer itself: the program decomposes node by node (it had gone to torch's
    re-trace, which asserted inside torch on Phi-3.5's longrope), and compiled it gives
    eager's output and final counter, with the counter read after its advance."""
    seq = Dim("seq", min=2, max=6)
    x, pos = torch.randn(3, 16), torch.tensor([2, 3, 4])
    ep = export.capture(CountedWrite(), (x, pos), dynamic_shapes=({0: seq}, {0: seq}))
    assert decompose_locally(ep, _table()) is not None
    eager, model = CountedWrite(), CountedWrite()
    exe = kiln.compile(model, (x, pos), dynamic_shapes=({0: seq}, {0: seq}))
    for t, start in ((3, 2), (5, 6)):
        x, pos = torch.randn(t, 16), torch.arange(start, start + t)
        want = eager(x, pos)
        assert torch.allclose(exe(x, pos), want)
        assert model.counter.item() == eager.counter.item() == start + t
