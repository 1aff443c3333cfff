"""A prefill attention takes its query's and key's prologues (RoPE, a k norm) from
regions of their own; a decode attention, a one-op prologue, a key read through a
gather and a cast, the CPU target and the two options keep them fused. The split plans
still match eager on the interpret target."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.bench.subject import PRESETS, build
from kiln.ir.plan import RegionKind
from tests.codegen.test_attention import AttentionBlock, block_dynamic_shapes, block_inputs
from tests.dispatch.test_fold_query_norm import _rotate_half
from tests.dispatch.test_split import CFG
from tests.helpers import rel_err


def _regions(exe_or_plan):
    plan = getattr(getattr(exe_or_plan, "program", None), "kplan", None)
    plan = plan.plan if plan is not None else exe_or_plan
    return plan, [r for r in plan.regions if r.kind == RegionKind.ATTENTION]


def _prefill_plan(target, **options):
    block = AttentionBlock(CFG).eval()
    return kiln.compile(block, block_inputs(CFG, 8), dynamic_shapes=block_dynamic_shapes(CFG),
                        target=target, compile_to="dispatch", options=options)


def _cats(region):
    return sum(o.target.startswith("aten.cat") for o in region.ops)


def test_prefill_query_and_key_rope_become_pointwise_regions_before_the_attention():
    plan, (attn,) = _regions(_prefill_plan("interpret"))
    names = [r.name for r in plan.regions]
    for role in ("query", "key"):
        split = plan.regions[names.index(f"{attn.name}_{role}")]
        assert names.index(split.name) < names.index(attn.name)
        assert split.kind == RegionKind.POINTWISE
        (out,) = split.outputs
        assert out in attn.inputs
    assert f"{attn.name}_value" not in names  # v is the projection's view: nothing to split
    assert sum("prefill tile" in n for n in attn.notes) == 2
    assert _cats(attn) == 0


@pytest.mark.parametrize("target,options,kept", [
    ("cpu", {}, 2),
    ("interpret", {"query_prologue_split": False, "key_prologue_split": False}, 2),
    ("interpret", {"query_prologue_split": False}, 1),
    ("interpret", {"key_prologue_split": False}, 1)])
def test_the_cpu_target_and_the_options_keep_prologues(target, options, kept):
    plan, (attn,) = _regions(_prefill_plan(target, **options))
    assert _cats(attn) == kept  # q's and k's RoPE each hold one cat
    split = {r.name.rsplit("_", 1)[-1] for r in plan.regions if r.name.startswith(attn.name + "_")}
    assert ("query" in split) == options.get("query_prologue_split", target != "cpu")
    assert ("key" in split) == options.get("key_prologue_split", target != "cpu")


class Scaled(torch.nn.Module):
    """One-op prologues (a scale): nothing to hold in registers, no split."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q * 0.5, k * 0.5, v, is_causal=True)


def test_a_one_op_prologue_stays_fused():
    T = torch.export.Dim("T", min=2, max=64)
    args = tuple(torch.randn(1, 2, 8, 16) for _ in range(3))
    plan = kiln.compile(Scaled(), args, dynamic_shapes=({2: T},) * 3, target="interpret",
                        compile_to="dispatch")
    assert not any(r.name.endswith(("_query", "_key")) for r in plan.regions)


class GatheredCache(torch.nn.Module):
    """Keys and values read from an fp16 cache through positions and cast: a paged
    cache's shape of prologue. Splitting it would copy the cache; it stays."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k_cache", torch.randn(1, 2, 40, 16).half())
        self.register_buffer("v_cache", torch.randn(1, 2, 40, 16).half())

    def forward(self, q, slots):
        k = self.k_cache[:, :, slots].float()
        v = self.v_cache[:, :, slots].float()
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_a_key_read_through_a_gather_and_a_cast_stays_fused():
    T = torch.export.Dim("T", min=2, max=32)
    q, slots = torch.randn(1, 2, 8, 16), torch.randperm(40)[:8]
    model = GatheredCache()
    exe = kiln.compile(model, (q, slots), dynamic_shapes=({2: T}, {0: T}), target="interpret")
    assert not any(r.name.endswith(("_key", "_value")) for r in exe.plan.regions)
    q, slots = torch.randn(1, 2, 21, 16), torch.randperm(40)[:21]
    assert rel_err(exe(q, slots), model(q, slots)) <= 1e-5


class QKNormNoCache(torch.nn.Module):
    """Qwen3's attention compiled without a cache (transformers' use_cache=False): q and
    k normalised per head, then RoPE, causal SDPA over the prompt's own keys."""

    def __init__(self, dim=64, heads=4, kv=2, hd=16, max_len=48):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv, hd
        self.q = torch.nn.Linear(dim, heads * hd, bias=False)
        self.k = torch.nn.Linear(dim, kv * hd, bias=False)
        self.v = torch.nn.Linear(dim, kv * hd, bias=False)
        self.q_norm = torch.nn.Parameter(1 + 0.2 * torch.randn(hd))
        self.k_norm = torch.nn.Parameter(1 + 0.2 * torch.randn(hd))
        angles = torch.arange(max_len)[:, None] * 0.3 ** torch.arange(hd // 2)[None, :]
        angles = torch.cat((angles, angles), -1)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def _heads(self, x, proj, n, w):
        B, T, _ = x.shape
        h = proj(x).view(B, T, n, self.hd).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (w * h.to(x.dtype)).transpose(1, 2)

    def forward(self, x):
        B, T, _ = x.shape
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        q = self._heads(x, self.q, self.h, self.q_norm)
        k = self._heads(x, self.k, self.kv, self.k_norm)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        v = self.v(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_key_norm_and_rope_run_apart_and_match_eager(dtype, tol):
    torch.manual_seed(0)
    model = QKNormNoCache().to(dtype).eval()
    T = torch.export.Dim("T", min=2, max=48)
    exe = kiln.compile(model, (torch.randn(1, 8, 64, dtype=dtype),), dynamic_shapes=({1: T},),
                       target="interpret", options={"tune": "none"})
    plan, (attn,) = _regions(exe)
    key = next(r for r in plan.regions if r.name == f"{attn.name}_key")
    # the norm's statistics are a reduction region of their own already; RoPE and the
    # norm's scaling move out of the key loop
    assert key.kind == RegionKind.POINTWISE and _cats(key) == 1
    assert _cats(attn) == 0
    assert exe.program.kplan.kernels[attn.name].kind == "triton"
    with torch.no_grad():
        for t in (5, 37):
            x = torch.randn(1, t, 64, dtype=dtype)
            assert rel_err(exe(x), model(x)) <= tol, t


def test_llama_block_runs_split_and_matches_eager():
    """kiln.models' attention without a cache: q's and k's RoPE apart, at lengths on
    both sides of a key block and below the decode tile."""
    block = AttentionBlock(CFG).eval()
    exe = kiln.compile(block, block_inputs(CFG, 8), dynamic_shapes=block_dynamic_shapes(CFG),
                       target="interpret", options={"tune": "none"})
    plan, (attn,) = _regions(exe)
    assert exe.program.kplan.kernels[attn.name].spec.meta["prologue_tiles"] == 0
    with torch.no_grad():
        for t in (1, 9, 30):
            a = block_inputs(CFG, t)
            assert rel_err(exe(*a), block(*a)) <= 1e-5, t


def test_prefill_runs_split_and_decode_keeps_the_prologue():
    """kiln bench's tiny subject (gpt-fast's layout: a static cache, q's RoPE before SDPA)
    on the interpret target: prefill at two lengths against eager, then a decode step."""
    s = PRESETS["tiny"]
    m = build(s, torch.float32, "cpu")
    seq = kiln.Dim("seq", min=2, max=s.max_len)
    ex = (torch.zeros(1, 16, dtype=torch.long), torch.arange(16))
    pre = kiln.compile(m, ex, dynamic_shapes=({1: seq}, {0: seq}), target="interpret",
                       options={"tune": "none"})
    plan, attns = _regions(pre)
    assert len(attns) == s.layers
    assert all(any(r.name == f"{a.name}_query" for r in plan.regions) for a in attns)
    # k is the cache, a state: no prologue of its own to split
    assert not any(r.name.endswith("_key") for r in plan.regions)
    # the mask's envelope still bounds the key loop (once lost by the split: the kernel
    # walked every key block, 513 us against 143 on an H200 at T 2048)
    assert all(a.key_bounds and set(a.key_bound_values()) <= set(a.inputs) for a in attns)
    assert all(pre.program.kplan.kernels[a.name].spec.meta["key_bounds"] for a in attns)
    with torch.no_grad():
        for t in (5, 37):
            idx, pos = torch.randint(0, s.vocab, (1, t)), torch.arange(t)
            assert rel_err(pre(idx, pos), m(idx, pos)) <= 1e-5, t
    dec = kiln.compile(m, (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long)),
                       target="interpret", compile_to="dispatch")
    assert not any(r.name.endswith(("_query", "_key")) for r in dec.regions)
