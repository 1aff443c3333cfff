"""A boolean SDPA mask that aranges prove `key <= query` becomes is_causal
(kiln.graph.causal_sdpa, read through kiln.graph.index_forms); every mask that is
something else, or built from data, stays. Numerics on the interpret target."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

SDPA = "aten.scaled_dot_product_attention.default"


def _sdpas(kg):
    return [n for n in kg.graph.nodes if n.op == "call_function" and str(n.target) == SDPA]


def _graph(model, args, dyn=None):
    return kiln.compile(model, args, dynamic_shapes=dyn, target="interpret", compile_to="graph")


class Masked(torch.nn.Module):
    """SDPA under a boolean mask `keep(kj, qi)` of the key and query indices, built from
    aranges (and, when `positions`, from the positions passed in)."""

    def __init__(self, keep, positions=False):
        super().__init__()
        self.keep, self.positions = keep, positions

    def forward(self, q, k, v, pos=None):
        T, S = q.shape[2], k.shape[2]
        qi = pos if self.positions else torch.arange(T)
        kj = torch.arange(S)
        mask = self.keep(kj[None, :], qi[:, None])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _qkv(T, S=None):
    S = S or T
    return torch.randn(1, 2, T, 8), torch.randn(1, 2, S, 8), torch.randn(1, 2, S, 8)


@pytest.mark.parametrize("keep", [
    lambda kj, qi: kj <= qi,
    lambda kj, qi: qi >= kj,
    lambda kj, qi: kj < qi + 1,
    lambda kj, qi: (kj - qi) <= 0,
    lambda kj, qi: (kj <= qi) & torch.ones((), dtype=torch.bool),
    lambda kj, qi: (kj + 3 <= qi + 3) & (kj >= 0),
    lambda kj, qi: kj.int() <= qi.int()])  # an integer cast keeps the values
def test_causal_masks_become_is_causal(keep):
    model = Masked(keep)
    T = torch.export.Dim("T", min=2, max=40)
    kg = _graph(model, _qkv(9), ({2: T}, {2: T}, {2: T}))
    (sdpa,) = _sdpas(kg)
    assert sdpa.kwargs.get("is_causal") is True and sdpa.kwargs["attn_mask"] is None
    exe = kiln.compile(model, _qkv(9), dynamic_shapes=({2: T}, {2: T}, {2: T}),
                       target="interpret")
    for t in (3, 33):
        args = _qkv(t)
        assert rel_err(exe(*args), model(*args)) <= 1e-5, t


@pytest.mark.parametrize("keep", [
    lambda kj, qi: kj < qi,  # the diagonal masked too
    lambda kj, qi: kj <= qi + 1,  # one key ahead
    lambda kj, qi: qi <= kj,  # the other triangle
    lambda kj, qi: (kj <= qi) & (kj > qi - 4),  # a sliding window
    lambda kj, qi: kj >= 0])  # all keys
def test_other_masks_stay(keep):
    kg = _graph(Masked(keep), _qkv(9))
    (sdpa,) = _sdpas(kg)
    assert not sdpa.kwargs.get("is_causal")
    assert len(sdpa.args) > 3 or sdpa.kwargs.get("attn_mask") is not None


def test_a_mask_from_positions_passed_in_stays():
    """A static cache's prompt: the query positions are data (transformers' recipe)."""
    model = Masked(lambda kj, qi: kj <= qi, positions=True)
    kg = _graph(model, (*_qkv(6, 16), torch.arange(6)))
    (sdpa,) = _sdpas(kg)
    assert not sdpa.kwargs.get("is_causal")


class PackedIds(torch.nn.Module):
    """transformers 5's mask without a cache: causal and-ed with equal packed-sequence
    ids, a cumsum of `diff(position_ids, prepend=first - 1) != 1`. `step`: the first
    dummy position's distance (1: the ids are all 0, the mask causal)."""

    def __init__(self, step=1):
        super().__init__()
        self.step = step

    def forward(self, q, k, v):
        T = q.shape[2]
        pos = torch.arange(T)[None]
        first = pos[:, :1] - self.step
        ids = torch.cumsum(torch.diff(pos, dim=-1, prepend=first) != 1, dim=-1)
        qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
        same = ids[0][qi] == ids[0][kj]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=(kj <= qi) & same)


@pytest.mark.parametrize("step,causal", [(1, True), (2, False)])
def test_packed_sequence_ids_over_aranges(step, causal):
    model = PackedIds(step)
    T = torch.export.Dim("T", min=2, max=40)
    dyn = ({2: T}, {2: T}, {2: T})
    (sdpa,) = _sdpas(_graph(model, _qkv(9), dyn))
    assert bool(sdpa.kwargs.get("is_causal")) == causal
    exe = kiln.compile(model, _qkv(9), dynamic_shapes=dyn, target="interpret")
    for t in (2, 21):
        args = _qkv(t)
        assert rel_err(exe(*args), model(*args)) <= 1e-5, t


def _tiny_llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_transformers_llama_without_a_cache_runs_causal_attention():
    """The prompt's mask (causal and packed-sequence ids) leaves the plan: no cumsum as a
    torch region, no mask envelope; logits as eager at other lengths."""
    model = _tiny_llama()
    T = kiln.Dim("T", min=2, max=64)
    ids = torch.randint(0, 100, (1, 9))
    exe = kiln.compile(model, (), {"input_ids": ids, "use_cache": False},
                       dynamic_shapes={"input_ids": {1: T}, "use_cache": None},
                       target="interpret")
    attns = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert len(attns) == 2 and not any(r.key_bounds for r in attns)
    assert all(exe.program.kplan.kernels[r.name].kind == "triton" for r in exe.plan.regions)
    with torch.no_grad():
        for t in (5, 40):
            ids = torch.randint(0, 100, (1, t))
            got = exe(input_ids=ids, use_cache=False).logits
            assert rel_err(got, model(input_ids=ids, use_cache=False).logits) <= 1e-5, t


def test_transformers_llama_with_a_padding_mask_keeps_it():
    """An attention_mask passed in (left padding) is data: the mask stays and pads."""
    model = _tiny_llama()
    ids, pad = torch.randint(0, 100, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    pad[1, :3] = 0
    exe = kiln.compile(model, (), {"input_ids": ids, "attention_mask": pad, "use_cache": False},
                       target="interpret")
    (sdpa, _) = _sdpas(kiln.compile(model, (), {"input_ids": ids, "attention_mask": pad,
                                                "use_cache": False},
                                    target="interpret", compile_to="graph"))
    assert not sdpa.kwargs.get("is_causal")
    with torch.no_grad():
        got = exe(input_ids=ids, attention_mask=pad, use_cache=False).logits
        ref = model(input_ids=ids, attention_mask=pad, use_cache=False).logits
    assert rel_err(got[0], ref[0]) <= 1e-5 and rel_err(got[1, 3:], ref[1, 3:]) <= 1e-5


class Additive(torch.nn.Module):
    """SDPA under an additive mask where(kj <= qi, zero, fill), as transformers' eager
    masks are made (finfo.min)."""

    def __init__(self, zero, fill):
        super().__init__()
        self.zero, self.fill = zero, fill

    def forward(self, q, k, v):
        T = q.shape[2]
        keep = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
        mask = torch.where(keep, torch.tensor(self.zero), torch.tensor(self.fill))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))


@pytest.mark.parametrize("zero,fill,causal", [
    (0.0, torch.finfo(torch.float32).min, True),
    (0.0, float("-inf"), True),
    (0.0, -100.0, False),  # a fill that does not drown every score
    (1.0, torch.finfo(torch.float32).min, False)])  # a bias on every kept score
def test_additive_masks(zero, fill, causal):
    model = Additive(zero, fill)
    (sdpa,) = _sdpas(_graph(model, _qkv(9)))
    assert bool(sdpa.kwargs.get("is_causal")) == causal
    exe = kiln.compile(model, _qkv(9), target="interpret")
    args = _qkv(9)
    assert rel_err(exe(*args), model(*args)) <= 1e-5


def test_transformers_eager_attention_without_a_cache_runs_causal():
    model = _tiny_llama()
    model.config._attn_implementation = "eager"
    ids = torch.randint(0, 100, (1, 11))
    kg = kiln.compile(model, (), {"input_ids": ids, "use_cache": False}, target="interpret",
                      compile_to="graph")
    assert all(s.kwargs.get("is_causal") for s in _sdpas(kg)) and len(_sdpas(kg)) == 2


class WindowPacked(PackedIds):
    """A sliding window (not causal) and-ed with the packed-sequence ids."""

    def forward(self, q, k, v):
        T = q.shape[2]
        pos = torch.arange(T)[None]
        ids = torch.cumsum(torch.diff(pos, dim=-1, prepend=pos[:, :1] - self.step) != 1, -1)
        qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
        keep = (kj <= qi) & (kj > qi - 4) & (ids[0][qi] == ids[0][kj])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("step,dropped", [(1, True), (2, False)])
def test_always_true_terms_of_a_window_mask_are_dropped(step, dropped):
    model = WindowPacked(step)
    T = torch.export.Dim("T", min=2, max=40)
    dyn = ({2: T}, {2: T}, {2: T})
    kg = _graph(model, _qkv(9), dyn)
    (sdpa,) = _sdpas(kg)
    assert not sdpa.kwargs.get("is_causal")
    cumsums = [n for n in kg.graph.nodes if str(n.target) == "aten.cumsum.default"]
    assert (not cumsums) == dropped
    exe = kiln.compile(model, _qkv(9), dynamic_shapes=dyn, target="interpret")
    for t in (2, 21):
        args = _qkv(t)
        assert rel_err(exe(*args), model(*args)) <= 1e-5, t


def test_gemma2_global_layers_soft_capped_attention_runs_causal():
    """kiln.ops.softcap_attention takes is_causal too: Gemma 2's global layer (its
    sliding one keeps the window, without the packed ids); logits as eager at two
    lengths on the interpret target."""
    import transformers

    cfg = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        attn_logit_softcapping=5.0, max_position_embeddings=64)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).eval()
    T = kiln.Dim("T", min=2, max=64)
    ids = torch.randint(0, 128, (1, 9))
    kw = dict(dynamic_shapes={"input_ids": {1: T}, "use_cache": None}, target="interpret")
    kg = kiln.compile(model, (), {"input_ids": ids, "use_cache": False}, compile_to="graph", **kw)
    capped = [n for n in kg.graph.nodes if str(n.target) == "kiln.softcap_attention.default"]
    assert [bool(n.kwargs.get("is_causal")) for n in capped] == [False, True]
    assert not any(str(n.target) == "aten.cumsum.default" for n in kg.graph.nodes)
    exe = kiln.compile(model, (), {"input_ids": ids, "use_cache": False}, **kw)
    with torch.no_grad():
        for t in (9, 30):
            ids = torch.randint(0, 128, (1, t))
            got = exe(input_ids=ids, use_cache=False).logits
            assert rel_err(got, model(input_ids=ids, use_cache=False).logits) <= 1e-5, t


def test_softcap_op_is_causal_is_its_tril_mask():
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    tril = torch.ones(5, 7, dtype=torch.bool).tril()
    causal = torch.ops.kiln.softcap_attention(q, k, v, None, 0.3, 5.0, is_causal=True)
    masked = torch.ops.kiln.softcap_attention(q, k, v, tril, 0.3, 5.0)
    assert rel_err(causal, masked) == 0


class WrappedIndex(torch.nn.Module):
    """Query positions read as a[a - 1] + 1: x - 1 + 1 by the formula, but torch reads
    a[-1] (the last row) at row 0, so row 0 passes every key: not causal."""

    def forward(self, q, k, v):
        T = q.shape[2]
        a = torch.arange(T)
        qi = a[a - 1] + 1
        keep = torch.arange(T)[None, :] <= qi[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def test_an_index_that_may_be_negative_is_not_followed():
    model = WrappedIndex()
    (sdpa,) = _sdpas(_graph(model, _qkv(9)))
    assert not sdpa.kwargs.get("is_causal")
    exe = kiln.compile(model, _qkv(9), target="interpret")
    args = _qkv(9)
    assert rel_err(exe(*args), model(*args)) <= 1e-5


class BufferMask(torch.nn.Module):
    """A mask read from a constant buffer, sliced to the prompt (nanoGPT's and
    gpt-fast's way): `table` is the buffer."""

    def __init__(self, table):
        super().__init__()
        self.register_buffer("table", table)

    def forward(self, q, k, v):
        T = q.shape[2]
        mask = self.table[:T, :T]
        keep = mask if mask.dtype == torch.bool else mask != 0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


_ONES = torch.ones(16, 16)
_FLIPPED = torch.tril(torch.ones(16, 16))
_FLIPPED[9, 3] = 0


@pytest.mark.parametrize("table,causal", [
    (torch.tril(_ONES), True),
    (torch.tril(_ONES).bool(), True),
    (torch.tril(_ONES, diagonal=-1), False),
    (torch.triu(_ONES), False),
    (_FLIPPED, False),
    (2 * torch.tril(_ONES), False)])  # != 0 is the same mask, but 2 is not read as 0 / 1
def test_a_tril_buffer_is_causal(table, causal):
    model = BufferMask(table)
    T = torch.export.Dim("T", min=2, max=15)  # a slice of all 16 rows is export's own case
    dyn = ({2: T}, {2: T}, {2: T})
    (sdpa,) = _sdpas(_graph(model, _qkv(9), dyn))
    assert bool(sdpa.kwargs.get("is_causal")) == causal
    exe = kiln.compile(model, _qkv(9), dynamic_shapes=dyn, target="interpret")
    for t in (2, 15):
        args = _qkv(t)
        out, ref = exe(*args), model(*args)
        assert rel_err(out.nan_to_num(), ref.nan_to_num()) <= 1e-5, t


def test_nanogpt_slow_path_runs_causal():
    from tests.graph.test_eager_attention import NanoGPTAttention

    model = NanoGPTAttention(dim=64, heads=4, block=32).eval()
    T = torch.export.Dim("T", min=2, max=31)
    kg = kiln.compile(model, (torch.randn(1, 16, 64),), dynamic_shapes=({1: T},),
                      target="interpret", compile_to="graph")
    assert [s.kwargs.get("is_causal") for s in _sdpas(kg)] == [True]


def test_a_tril_whose_rows_are_not_the_second_last_dim_is_not_read():
    """A [16, 1, 16] tril (a unit dim between rows and keys) read as [T, 1, T]: its rows
    are dim 0, not the query dim the mask broadcasts as; it stays a mask."""

    class Gapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.tril(torch.ones(16, 16)).view(16, 1, 16))

        def forward(self, q, k, v):
            T = q.shape[2]
            keep = self.table[:T, :, :T].permute(1, 0, 2) != 0
            return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    T = torch.export.Dim("T", min=2, max=15)  # dynamic: fold_constants cannot fold the slice
    dyn = ({2: T}, {2: T}, {2: T})
    (sdpa,) = _sdpas(_graph(Gapped(), _qkv(9), dyn))
    assert not sdpa.kwargs.get("is_causal")  # only a tril in the last two dims is read
    exe = kiln.compile(Gapped(), _qkv(9), dynamic_shapes=dyn, target="interpret")
    for t in (2, 15):
        args = _qkv(t)
        assert rel_err(exe(*args), Gapped()(*args)) <= 1e-5, t
