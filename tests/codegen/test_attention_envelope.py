"""Attention whose key loop is bounded by its mask's envelope (dispatch/mask_envelope.py),
against eager on fresh random inputs: a causal mask sliced from a buffer over a static
cache (prefill and decode, as kiln bench's model), a sliding window, a left-padded
batch, random boolean and additive masks with fully masked rows, masks whose envelope says
all (causal, windows: the mask is never read) and ones that are nearly so; under Triton's
interpreter (the envelope's and attention's kernels) and on the CPU target (no
envelope: SDPA as torch ops)."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.ir.plan import RegionKind
from tests.helpers import rel_err

TARGETS = ["interpret", "cpu"]
T = torch.export.Dim("T", min=1, max=96)


def _attention(exe):
    (region,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    return region, exe.program.kplan.kernels[region.name]


def _bounded(exe, target):
    """On a kernel target the attention kernel reads an envelope from its own kernel."""
    region, kernel = _attention(exe)
    if target == "cpu":
        assert region.key_bounds is None
        return
    assert isinstance(kernel, TritonKernel) and kernel.spec.meta["key_bounds"]
    (env,) = [r for r in exe.plan.regions if set(r.outputs) == set(region.key_bound_values())]
    assert isinstance(exe.program.kplan.kernels[env.name], TritonKernel), env.notes


class StaticCache(torch.nn.Module):
    """gpt-fast's attention: SDPA over a static [1, Hkv, S, D] cache with a boolean
    causal mask sliced from a buffer by the input positions, GQA by repeat_interleave."""

    def __init__(self, s: int = 150):
        super().__init__()
        self.register_buffer("causal", torch.tril(torch.ones(s, s, dtype=torch.bool)))

    def forward(self, q, k_cache, v_cache, input_pos):
        mask = self.causal[None, None, input_pos]
        rep = q.shape[1] // k_cache.shape[1]
        k, v = (c.repeat_interleave(rep, dim=1) for c in (k_cache, v_cache))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("target", TARGETS)
def test_static_cache_prefill_and_decode(target):
    model = StaticCache()
    cache = lambda: torch.randn(1, 2, 150, 16)  # noqa: E731
    args = (torch.randn(1, 4, 8, 16), cache(), cache(), torch.arange(8))
    exe = kiln.compile(model, args, dynamic_shapes=({2: T}, None, None, {0: T}),
                       target=target)
    _bounded(exe, target)
    for start, t in ((0, 90), (70, 1), (131, 1), (40, 30)):  # prefill, decode, a chunk
        args = (torch.randn(1, 4, t, 16), cache(), cache(), torch.arange(start, start + t))
        assert rel_err(exe(*args), model(*args)) <= 1e-5, (start, t)


class Masked(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _sliding(t, s, window):
    i = torch.arange(s - t, s)[:, None]  # the queries are the last t positions
    j = torch.arange(s)[None, :]
    return (j <= i) & (j > i - window)


def _left_padded(b, t, pads):
    """Causal over a batch whose row r starts after pads[r] padding tokens: the padding
    queries see nothing (fully masked rows)."""
    j = torch.arange(t)
    causal = j[None, :] <= j[:, None]
    keep = j[None, :] >= torch.tensor(pads)[:, None]
    return (causal[None] & keep[:, None, :] & keep[:, :, None])[:, None]


def _random_bool(b, h, t, s):
    mask = torch.rand(b, h, t, s) > 0.8
    mask[:, :, t // 2] = False  # a fully masked row
    return mask


def _additive(t, s):
    mask = torch.randn(1, 1, t, s)
    dead = torch.rand(1, 1, t, s) > 0.3
    dead[..., :, : s // 2] = True  # the first half of the keys dead for every row
    mask[dead] = float("-inf")
    mask[..., t // 2, :] = float("-inf")  # a fully masked row
    return mask


def _causal_hole(t, s):
    """Causal (the queries the last t positions) but one row misses one key inside its
    span: the envelope is no longer plain, the mask tile must be read."""
    mask = _sliding(t, s, s)
    mask[t // 2, (s - t + t // 2) // 2] = False
    return mask


def _additive_causal(t, s, bias=0.0):
    """A float causal mask (0 where live, -inf where not), as some models pass it; with
    `bias` at one live key the mask says more than its envelope."""
    mask = torch.zeros(1, 1, t, s).masked_fill(~_sliding(t, s, s), float("-inf"))
    mask[..., t // 2, 0] = bias
    return mask


MASKS = {  # name -> (batch, heads, kv heads, query and key lengths -> mask)
    "sliding window": (1, 4, 2, lambda t, s: _sliding(t, s, 24)),
    "left padded": (3, 2, 2, lambda t, s: _left_padded(3, t, [0, 5, 70])),
    "random bool": (2, 4, 2, lambda t, s: _random_bool(2, 4, t, s)),
    "additive": (1, 2, 1, _additive),
    "causal with a hole": (1, 4, 2, _causal_hole),
    "additive causal": (1, 4, 1, _additive_causal),
    "additive causal, one bias": (1, 4, 1, lambda t, s: _additive_causal(t, s, 0.5)),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", list(MASKS))
def test_masks_match_eager(name, target):
    b, h, hkv, make = MASKS[name]
    padded = name == "left padded"  # a self-attention batch: keys are the queries
    sizes = [(80, 80), (9, 9)] if padded else [(40, 140), (1, 70), (7, 129)]

    def args(t, s):
        return (torch.randn(b, h, t, 16), torch.randn(b, hkv, s, 16),
                torch.randn(b, hkv, s, 16), make(t, s))

    S = torch.export.Dim("S", min=2, max=160)
    rows = S if padded else T
    first = args(*sizes[0])
    n = first[3].dim()
    ds = ({2: rows}, {2: S}, {2: S}, {n - 2: rows, n - 1: S})
    exe = kiln.compile(Masked(), first, dynamic_shapes=ds, target=target)
    _bounded(exe, target)
    for t, s in sizes:
        a = args(t, s)
        out, ref = exe(*a), Masked()(*a)
        assert torch.isfinite(out).all(), (name, t, s)
        assert rel_err(out, ref) <= 1e-5, (name, t, s)


def test_half_precision_prefill_with_a_sliding_window():
    make = MASKS["sliding window"][3]
    h = torch.float16
    a = (torch.randn(1, 4, 64, 32, dtype=h), torch.randn(1, 2, 200, 32, dtype=h),
         torch.randn(1, 2, 200, 32, dtype=h), make(64, 200))
    exe = kiln.compile(Masked(), a, target="interpret")
    _bounded(exe, "interpret")
    ref = Masked()(*(x.float() if x.is_floating_point() else x for x in a))
    assert rel_err(exe(*a).float(), ref) <= 1e-2


@pytest.mark.parametrize("name", ["random bool", "additive", "sliding window"])
def test_dead_keys_inside_the_envelope_may_hold_nan(name):
    """Inside the envelope the key loop reads every key (its loads wait on no mask); a
    key no row lets through is kept out by its score and a zeroed V row, so NaN there
    (a cache row never written) changes nothing, decode and prefill; with the mask read
    (random, additive) and without (a window: its rows' bounds)."""
    b, h, hkv, make = MASKS[name]
    S = torch.export.Dim("S", min=2, max=160)
    first = (torch.randn(b, h, 40, 16), torch.randn(b, hkv, 140, 16),
             torch.randn(b, hkv, 140, 16), make(40, 140))
    n = first[3].dim()
    exe = kiln.compile(Masked(), first, target="interpret",
                       dynamic_shapes=({2: T}, {2: S}, {2: S}, {n - 2: T, n - 1: S}))
    _bounded(exe, "interpret")
    for t, s in ((1, 70), (7, 129)):
        q, k, v, mask = (torch.randn(b, h, t, 16), torch.randn(b, hkv, s, 16),
                         torch.randn(b, hkv, s, 16), make(t, s))
        live = mask if mask.dtype == torch.bool else mask != float("-inf")
        dead = ~live.expand(b, h, t, s).any(dim=(1, 2))  # [b, s]: dead for every row
        assert dead.any()
        kn, vn = k.clone(), v.clone()
        kn.masked_fill_(dead[:, None, :, None], float("nan"))
        vn.masked_fill_(dead[:, None, :, None], float("nan"))
        out = exe(q, kn, vn, mask)
        assert torch.isfinite(out).all(), (name, t, s)
        assert rel_err(out, Masked()(q, k, v, mask)) <= 1e-5, (name, t, s)


@pytest.mark.parametrize("prefix", [False, True], ids=["holed buffer", "prefix"])
def test_the_key_loops_cover_each_split_once_and_read_the_mask_only_where_it_matters(prefix):
    """The kernel's key loops (a plain envelope's: edges by the rows' bounds, inside
    unmasked; the mask's, under `if not plain`: in range / at the edge), their bounds
    and branch run as Python over every case of a split's [lo, hi) (hi < lo for
    a split past the keys), the span inside every row's bounds and whether the envelope
    is plain: together they visit each block of [lo, hi) once and nothing else, and the
    mask is read only where the envelope is not plain. (A split past the keys once
    walked [hi, lo) with the mask read: 3-4x a decode attention's time on an H200,
    right results.) A causal buffer with a hole stays a mask read tile by tile; a whole
    one is a prefix of the keys a row (graph/tril_rows.py): plain loops only."""
    import itertools
    from types import SimpleNamespace

    model = StaticCache()
    if not prefix:
        model.causal[40, 3] = False
    args = (torch.randn(1, 4, 8, 16), torch.randn(1, 2, 150, 16),
            torch.randn(1, 2, 150, 16), torch.arange(8))
    exe = kiln.compile(model, args, dynamic_shapes=({2: T}, None, None, {0: T}),
                       target="interpret")
    skeleton, loops = _loop_skeleton(_attention(exe)[1].spec.source)
    want = [("lo", "in_a"), ("in_a", "in_b")] + (
        [("in_b", "hi")] if prefix else [("edge_b", "hi"), ("lo", "mid"), ("mid", "hi")])
    assert sorted(loops) == sorted(want), loops
    code = compile("\n".join(skeleton), "skeleton", "exec")
    tl = SimpleNamespace(where=lambda c, a, b: a if c else b, minimum=min, maximum=max)
    n = 16
    for lo, hi, in_lo, in_hi, full_end, plain in itertools.product(
            range(0, 97, n), range(0, 100, 7), range(0, 97, n), range(0, 97, n),
            (48, 96), (True,) if prefix else (False, True)):
        walked = {}
        env = {"tl": tl, "lo": lo, "hi": hi, "in_lo": in_lo, "in_hi": in_hi,
               "full_end": full_end, "plain": plain,
               "walk": lambda a, b, x, y, w=walked: w.setdefault((a, b), []).extend(
                   range(x, y, n))}
        exec(code, env)
        seen = sorted(k for w in walked.values() for k in w)
        assert seen == list(range(lo, hi, n)), (lo, hi, in_lo, in_hi, plain, walked)
        reads_mask = sum((w for (a, b), w in walked.items() if "mid" in (a, b)), [])
        assert not reads_mask if plain else sorted(reads_mask) == seen, walked
        assert all(in_lo <= k < in_hi for k in walked.get(("in_a", "in_b"), [])), walked


def _loop_skeleton(source: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The attention kernel's key-loop control from `mid = ...` to the loops' end, as
    Python: each loop becomes walk('start', 'end', start, end), its body dropped."""
    import re

    lines = source.splitlines()
    first = next(i for i, x in enumerate(lines)
                 if x.strip() == "mid = tl.minimum(hi, tl.maximum(lo, full_end))")
    base = len(lines[first]) - len(lines[first].lstrip())
    skeleton, loops, body_of = [], [], None
    for line in lines[first:]:
        text, ind = line.strip(), len(line) - len(line.lstrip())
        if not text or (body_of is not None and ind > body_of):
            continue
        body_of = None
        loop = re.fullmatch(r"for start_n in range\((\w+), (\w+), BLOCK_N\):", text)
        if ind == base and loops and not loop and \
                not text.startswith(("if plain", "if not plain", "else:")):
            break  # past the key loops
        pad = " " * (ind - base)
        if loop:
            loops.append(loop.groups())
            skeleton.append(f"{pad}walk({loop[1]!r}, {loop[2]!r}, {loop[1]}, {loop[2]})")
            body_of = ind
        else:
            skeleton.append(pad + text)
    return skeleton, loops


def test_rows_whose_spans_share_no_key_read_the_mask():
    """Two packed documents with dead keys between them: every row's keys are one run,
    but the runs do not meet, so the keys some row passes are not one run and the
    envelope alone cannot keep the gap's V rows (NaN: never written) out; the mask is
    read and the output stays exact."""
    t, gap = 40, 3
    p = torch.arange(t)
    j = p[None, :]
    doc_a = (p[:, None] < t // 2) & (j <= p[:, None]) & (j < t // 2 - gap)
    doc_b = (p[:, None] >= t // 2) & (j <= p[:, None]) & (j >= t // 2)
    mask = (doc_a | doc_b)[None, None]
    q, k, v = (torch.randn(1, 2, t, 16) for _ in range(3))
    exe = kiln.compile(Masked(), (q, k, v, mask), target="interpret")
    _bounded(exe, "interpret")
    kn, vn = k.clone(), v.clone()
    kn[:, :, t // 2 - gap:t // 2] = float("nan")
    vn[:, :, t // 2 - gap:t // 2] = float("nan")
    out = exe(q, kn, vn, mask)
    assert torch.isfinite(out).all()
    assert rel_err(out, Masked()(q, k, v, mask)) <= 1e-5


def _spans(shape, s, kind, gen):
    """A bool mask of `shape` + [s] whose each row passes one run of keys: runs that
    meet (all hold one key), independent runs, or independent with the first row's
    empty."""
    if kind == "meet":
        c = int(torch.randint(0, s, (), generator=gen))
        lo = torch.randint(0, c + 1, shape, generator=gen)
        hi = torch.randint(c + 1, s + 1, shape, generator=gen)
    else:
        lo = torch.randint(0, s, shape, generator=gen)
        hi = torch.clamp(lo + torch.randint(0, s, shape, generator=gen), max=s)
        if kind == "empty row":
            hi[..., 0] = lo[..., 0]
    j = torch.arange(s)
    return (j >= lo[..., None]) & (j < hi[..., None])


@pytest.mark.parametrize("dtype,heads,hkv,mask_heads", [(torch.bool, 4, 2, 4),
                                                        (torch.float32, 2, 1, 1)])
def test_random_runs_of_keys_match_eager(dtype, heads, hkv, mask_heads):
    """Random per-row runs (plain or not by the draw; a float mask sometimes biased),
    NaN in the keys no row passes: equal to eager on every row that passes a key."""
    gen = torch.Generator().manual_seed(hash((dtype, heads)) % 1000)
    S = torch.export.Dim("S", min=2, max=160)

    def as_mask(m, biased):
        if dtype == torch.bool:
            return m
        out = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
        return out + (torch.randn(m.shape, generator=gen) * m) if biased else out

    first = (torch.randn(2, heads, 9, 16), torch.randn(2, hkv, 50, 16),
             torch.randn(2, hkv, 50, 16), as_mask(torch.ones(2, mask_heads, 9, 50) > 0, False))
    exe = kiln.compile(Masked(), first, target="interpret",
                       dynamic_shapes=({2: T}, {2: S}, {2: S}, {2: T, 3: S}))
    _bounded(exe, "interpret")
    cases = [(1, 70, "meet"), (5, 40, "independent"), (33, 130, "meet"),
             (9, 150, "empty row"), (20, 64, "meet")]
    for i, (t, s, kind) in enumerate(cases):
        m = _spans((2, mask_heads, t), s, kind, gen)
        mask = as_mask(m, biased=i == 2)
        q, k, v = (torch.randn(2, n, length, 16, generator=gen)
                   for n, length in ((heads, t), (hkv, s), (hkv, s)))
        dead = ~m.expand(2, heads, t, s).any(dim=(1, 2))  # [2, s]
        kn, vn = (x.masked_fill(dead[:, None, :, None], float("nan")) for x in (k, v))
        out, ref = exe(q, kn, vn, mask), Masked()(q, k, v, mask)
        rows = m.expand(2, heads, t, s).any(-1)
        assert torch.isfinite(out[rows]).all(), (t, s, kind)
        assert rel_err(out[rows], ref[rows]) <= 1e-5, (t, s, kind)
