"""The node-by-node decomposition (the default on torch >= 2.11) gives torch's
re-trace's program: the same ops with the same arguments, sizes and signature, named
by the same scheme. Cheap: both decompositions of one capture, nothing compiled."""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import Dim

from kiln.errors import KilnError
from kiln.frontend import export
from kiln.frontend.export import import_model
from kiln.frontend.local_decompose import _TORCH, decompose_locally
from kiln.graph.cse import cse
from kiln.ir.ops import op_name
from kiln.models.generate import generation_inputs
from kiln.models.llama import tiny_llama
from kiln.models.qwen3_next import Qwen3Next, Qwen3NextConfig
from kiln.pipeline import Context

pytestmark = pytest.mark.skipif(_TORCH < (2, 11), reason="node by node on torch >= 2.11")


def _conv_bn():
    """Eval BatchNorm (the re-trace reaches _native_batch_norm_legit_no_training, kiln's
    per-channel affine form, through native_batch_norm's Python kernel) and bilinear
    upsampling, in an nn.Sequential: its argument is named `input`, a builtin's name."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Upsample(scale_factor=2, mode="bilinear")).eval()


class Projections(nn.Module):
    """One input viewed once per Linear: three equal views, for CSE to merge."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) * self.v(x)


class Casts(nn.Module):
    """Two casts of one signature (one trace spliced twice) read by one cat, and a cat
    of one value twice: distinct values must stay distinct, one value one."""

    def forward(self, x, y):
        a, b = x.isnan().float(), x.isinf().float()
        return torch.cat([a, b, y, y]).clamp(min=0.0)


class Means(nn.Module):
    """x.numel() on symbolic shapes: the re-trace multiplies the sizes (a size of 1
    dropped), it never keeps aten.sym_numel."""

    def forward(self, x, y):
        return x.sum() / x.numel() + y.sum() / y.numel()


def _llama(seq_len):
    model = tiny_llama(n_layers=1)
    model.setup_cache(max_batch_size=4, paged=True, block_size=4)
    kwargs, shapes = generation_inputs(model, 4, seq_len, "cpu", paged=True)
    return model, (), kwargs, shapes


class StateRead(nn.Module):
    """A buffer viewed and the view read (a view of the view too), then the buffer
    written in place (Qwen3-Next's linear-attention state): the view shows the old
    value, as the functional program computes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(4, 3, 5))

    def forward(self, x):
        old = self.state[: x.shape[0]]
        y = torch.where(x > 0, old.transpose(1, 2)[:, 0, :, None], x) + old[:, :1].sum()
        self.state[torch.arange(x.shape[0])] = x.exp()
        return y


def _qwen3_next(seq_len):
    """One gated delta rule layer with an MoE: its recurrent and convolution state read
    as views, then written per row (the KV cache of its attention layers is Llama's)."""
    cfg = Qwen3NextConfig(
        vocab_size=64, dim=32, n_layers=1, layer_types=("linear_attention",),
        n_heads=2, n_kv_heads=1, head_dim=16, linear_k_heads=1, linear_v_heads=2,
        linear_k_dim=8, linear_v_dim=8, intermediate_size=48, n_experts=2,
        experts_per_token=1, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        max_seq_len=32)
    model = Qwen3Next(cfg).eval()
    model.setup_cache(max_batch_size=2)
    kwargs, shapes = generation_inputs(model, 2, seq_len, "cpu")
    return model, (), kwargs, shapes


CASES = {
    "conv_bn": lambda: (_conv_bn(), (torch.randn(2, 3, 6, 6),), None,
                        ({0: Dim("n", min=1, max=8)},)),
    "views": lambda: (Projections(), (torch.randn(1, 5, 8),), None, ({1: Dim("T", min=1)},)),
    "casts": lambda: (Casts(), (torch.randn(2, 3), torch.randn(2, 3)), None, None),
    "numel": lambda: (Means(), (torch.randn(4, 3, 5), torch.randn(1, 6, 1)), None,
                      ({1: Dim("a", min=2), 2: Dim("b", min=2)}, {1: Dim("c", min=2)})),
    "llama_prefill": lambda: _llama(None),
    "llama_decode": lambda: _llama(1),
    "state_read": lambda: (StateRead(), (torch.randn(2, 3, 5),), None,
                           ({0: Dim("b", min=2, max=4)},)),
    "qwen3_next_prefill": lambda: _qwen3_next(None),
    "qwen3_next_decode": lambda: _qwen3_next(1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_program_as_the_retrace(case):
    model, args, kwargs, shapes = CASES[case]()
    ep = export.capture(model, args, kwargs, shapes)
    table = export.kiln_table()
    local = decompose_locally(ep, table)
    assert local is not None  # each of these is plain enough to decompose node by node
    ref = ep.run_decompositions(table)
    assert Counter(_ops(local)) == Counter(_ops(ref))
    assert _structure(local) == _structure(ref)
    assert _placeholders(local) == _placeholders(ref)
    assert _sizes(local) == _sizes(ref)
    assert _specs(local) == _specs(ref)
    for n in local.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) \
                and not str(n.target).startswith("aten.sym_"):
            assert re.fullmatch(rf"{n.target.overloadpacket.__name__}(_\d+)?", n.name), n.name


class CacheRead(nn.Module):
    """A buffer written, then a view of it split, both halves read (DeepSeek-V3's latent
    cache): the re-trace's functionalization takes the view again for each half."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(8, 6))

    def forward(self, x, pos):
        self.cache.index_copy_(0, pos, x)
        k, v = self.cache[: x.shape[0]].split([4, 2], -1)
        return k.sum(-1) + v.sum(-1)


def test_views_of_a_written_buffer_are_taken_once(monkeypatch):
    """The same values as the re-trace, each computed once where the re-trace repeats
    the view chain per use; after kiln's CSE the two programs are one."""
    n = Dim("n", min=2, max=8)
    args, shapes = (torch.randn(3, 6), torch.arange(3)), ({0: n}, {0: n})
    ep = export.capture(CacheRead(), args, None, shapes)
    table = export.kiln_table()
    local, ref = decompose_locally(ep, table), ep.run_decompositions(table)
    assert local is not None
    assert set(_structure(local)) == set(_structure(ref))
    assert _structure(local) <= _structure(ref)
    merged = {}
    for way in ("local", "retrace"):
        monkeypatch.setenv("KILN_DECOMPOSE", way)
        kg = cse(import_model(CacheRead(), args, dynamic_shapes=shapes), Context(target=None))
        merged[way] = Counter(op_name(n.target) for n in kg.graph.nodes
                              if n.op == "call_function")
    assert merged["local"] == merged["retrace"]


class StateReadLate(nn.Module):
    """A view of a buffer taken before the buffer is written and read after it, itself
    (`late=0`) or through a view of the view also taken before (`late=1`): eager reads
    the new value there, which the functional program's old view cannot show."""

    def __init__(self, late: int):
        super().__init__()
        self.late = late
        self.register_buffer("state", torch.zeros(4, 3, 5))

    def forward(self, x):
        old = self.state[: x.shape[0]]
        early, turned = old.sum(), old.transpose(1, 2)  # reads before do not make it safe
        self.state[torch.arange(x.shape[0])] = x.exp()
        return early + (old if self.late == 0 else turned[:, 0]).sum(-1)


@pytest.mark.parametrize("late", [0, 1])
def test_a_view_read_after_its_buffer_is_written_is_left_to_the_retrace(late):
    x = torch.randn(2, 3, 5)
    ep = export.capture(StateReadLate(late), (x,), None, ({0: Dim("b", min=2, max=4)},))
    table = export.kiln_table()
    assert decompose_locally(ep, table) is None
    got = ep.run_decompositions(table).module()(x)
    assert torch.allclose(got, StateReadLate(late)(x))  # the write, seen through the view


def test_retrace_when_asked_and_bad_values_refused(monkeypatch):
    model, args, kwargs, shapes = CASES["views"]()
    ep = export.capture(model, args, kwargs, shapes)
    monkeypatch.setenv("KILN_DECOMPOSE", "retrace")
    assert decompose_locally(ep, export.kiln_table()) is None
    monkeypatch.setenv("KILN_DECOMPOSE", "node-by-node")
    with pytest.raises(KilnError, match="KILN_DECOMPOSE"):
        decompose_locally(ep, export.kiln_table())


def _ops(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def _structure(ep) -> Counter:
    """Every op node as a digest of its op and arguments, inputs in turn digested down
    to placeholders and size symbols: equal multisets are one program up to node order
    and names."""
    memo: dict[fx.Node, str] = {}

    def spelled(n: fx.Node) -> str:
        if n not in memo:
            val = n.meta.get("val")
            if n.op == "placeholder":
                memo[n] = n.name
            elif isinstance(val, torch.SymInt):
                memo[n] = str(val.node.expr)
            else:
                args = pytree.tree_map(lambda a: spelled(a) if isinstance(a, fx.Node)
                                       else repr(a), (n.args, n.kwargs))
                memo[n] = hashlib.sha1(f"{n.target}{args}".encode()).hexdigest()
        return memo[n]

    return Counter(spelled(n) for n in ep.graph.nodes if n.op == "call_function"
                   and not isinstance(n.meta.get("val"), torch.SymInt))


def _placeholders(ep) -> list[tuple[str, str]]:
    return [(n.name, str(getattr(n.meta["val"], "shape", n.meta["val"])))
            for n in ep.graph.nodes if n.op == "placeholder"]


def _sizes(ep) -> set[str]:
    """The size expressions the program reads, and every node's symbolic shape."""
    out = set()
    for n in ep.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.SymInt):
            out.add(f"size {val.node.expr}")
        elif isinstance(val, torch.Tensor):
            out.add(f"{n.target} {tuple(val.shape)} {val.dtype}")
    return out


def _specs(ep) -> list:
    sig = ep.graph_signature
    return ([(s.kind.name, s.target, s.arg.name) for s in sig.input_specs],
            [(s.kind.name, s.target) for s in sig.output_specs])
