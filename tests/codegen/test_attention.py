"""The attention template under Triton's interpreter: GQA, causal, boolean and additive
masks, masks and RoPE computed in the prologue, dynamic lengths with tails, decode
against a KV cache; compared with eager PyTorch."""

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.ir.plan import RegionKind
from kiln.models.kv_cache import ContiguousKVCache
from kiln.models.llama import Attention, LlamaConfig, attention_mask, rope_tables
from tests.helpers import rel_err


def _attention_kernel(exe):
    (region,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    return region, exe.program.kplan.kernels[region.name]


class Sdpa(torch.nn.Module):
    def __init__(self, causal=False, gqa=True, scale=None):
        super().__init__()
        self.causal, self.gqa, self.scale = causal, gqa, scale

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                              scale=self.scale, enable_gqa=self.gqa)


def _qkv(b, h, hkv, t, s, d=16, dtype=torch.float32):
    return (torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, hkv, s, d, dtype=dtype),
            torch.randn(b, hkv, s, d, dtype=dtype))


L = torch.export.Dim("L", min=1, max=64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_gqa_with_dynamic_length_matches_eager(causal, dtype, tol):
    model = Sdpa(causal=causal, scale=0.3 if causal else None)
    args = _qkv(2, 4, 2, 9, 9, dtype=dtype)
    ds = ({2: L}, {2: L}, {2: L})
    exe = kiln.compile(model, args, dynamic_shapes=ds, target="interpret")
    region, kernel = _attention_kernel(exe)
    assert kernel.kind == "triton" and kernel.spec.meta["group"] == 2
    for t in (9, 1, 37):  # tails of BLOCK_M and BLOCK_N; a single query
        args = _qkv(2, 4, 2, t, t, dtype=dtype)
        assert rel_err(exe(*args), model(*args)) <= tol, t


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_mask_input_broadcast_over_batch_and_heads(kind):
    model = Sdpa()
    q, k, v = _qkv(2, 4, 4, 11, 13)
    mask = torch.rand(11, 13) > 0.3 if kind == "bool" else torch.randn(1, 4, 11, 13)
    exe = kiln.compile(model, (q, k, v, mask), target="interpret")
    assert _attention_kernel(exe)[1].kind == "triton"
    mask = torch.rand(11, 13) > 0.3 if kind == "bool" else torch.randn(1, 4, 11, 13)
    assert rel_err(exe(q, k, v, mask), model(q, k, v, mask)) <= 1e-5


class PaddingMasked(torch.nn.Module):
    """transformers' additive padding mask: finfo.min, not -inf, where a key is padding."""

    def forward(self, q, k, v, keep):
        mask = torch.where(keep[:, None, None, :], 0.0, torch.finfo(q.dtype).min)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_row_of_finfo_min_is_uniform_as_in_eager():
    """A padded query whose every key is finfo.min (T5's encoder, a padded sentence)
    attends to all keys alike in eager; scaled to base 2, finfo.min had overflowed to
    -inf and the row came out empty (0)."""
    q, k, v = _qkv(2, 2, 2, 5, 5)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0, 3:] = False
    keep[1] = False
    exe = kiln.compile(PaddingMasked(), (q, k, v, keep), target="interpret")
    assert _attention_kernel(exe)[1].kind == "triton"
    assert rel_err(exe(q, k, v, keep), PaddingMasked()(q, k, v, keep)) <= 1e-5


class PositionMasked(torch.nn.Module):
    """The mask is built inside the region from arange and input positions (a prologue)."""

    def forward(self, q, k, v, input_pos):
        span = torch.arange(k.shape[2])
        mask = span[None, :] <= input_pos[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def test_mask_computed_in_the_prologue_from_input_positions():
    q, k, v = _qkv(1, 4, 1, 5, 24)  # MQA: one kv head
    pos = torch.arange(7, 12)
    exe = kiln.compile(PositionMasked(), (q, k, v, pos), target="interpret")
    region, kernel = _attention_kernel(exe)
    assert any(o.target == "aten.le.Tensor" for o in region.ops)  # fused, not a region
    assert kernel.kind == "triton"
    pos = torch.tensor([3, 9, 23, 0, 15])
    assert rel_err(exe(q, k, v, pos), PositionMasked()(q, k, v, pos)) <= 1e-5


def test_three_dimensional_operands():
    model = Sdpa(causal=True, gqa=False)
    q, k, v = torch.randn(3, 10, 16), torch.randn(3, 10, 16), torch.randn(3, 10, 16)
    exe = kiln.compile(model, (q, k, v), target="interpret")
    assert _attention_kernel(exe)[1].kind == "triton"
    assert rel_err(exe(q, k, v), model(q, k, v)) <= 1e-5


class ConstantOperands(torch.nn.Module):
    """Keys (or values) that are a constant: the operand is a literal, not a load
    (fuzzer seed 500172 crashed the interpreter broadcasting a Python float)."""

    def __init__(self, which: str):
        super().__init__()
        self.which = which

    def forward(self, q, x, mask):
        ones = torch.full_like(x, 0.5)
        k, v = (ones, x) if self.which == "k" else (x, ones)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_constant_key_or_value_operand(which, dtype, tol):
    model = ConstantOperands(which)
    q, x = torch.randn(2, 3, 5, 8, dtype=dtype), torch.randn(2, 3, 7, 8, dtype=dtype)
    mask = torch.rand(5, 7) < 0.7
    exe = kiln.compile(model, (q, x, mask), target="interpret")
    assert _attention_kernel(exe)[1].kind == "triton"
    assert rel_err(exe(q, x, mask), model(q, x, mask)) <= tol


class AttentionBlock(torch.nn.Module):
    """kiln.models.llama.Attention (RoPE, GQA, optional KV cache) on plain tensor inputs."""

    def __init__(self, cfg: LlamaConfig, cache=None):
        super().__init__()
        self.attn = Attention(cfg, None)
        self.attn.kv_cache = cache

    def forward(self, x, cos, sin, mask, input_pos):
        return self.attn(x, cos, sin, {None: mask}, input_pos, None)


def block_inputs(cfg: LlamaConfig, t: int, start: int = 0, dtype=torch.float32,
                 cached: bool = False, device=None):
    """x, cos, sin, mask, input_pos for `t` tokens at positions start.., as Llama builds them."""
    cos, sin = rope_tables(cfg)
    pos = torch.arange(start, start + t)[None]
    kv_pos = torch.arange(cfg.max_seq_len)[None] if cached else pos
    args = (torch.randn(1, t, cfg.dim, dtype=dtype), cos[pos][:, :, None].to(dtype),
            sin[pos][:, :, None].to(dtype), attention_mask(pos, kv_pos, None), pos)
    return tuple(a.to(device) for a in args) if device is not None else args


def block_dynamic_shapes(cfg: LlamaConfig, cached: bool = False):
    T = torch.export.Dim("T", min=1, max=cfg.max_seq_len)
    mask = {2: T} if cached else {2: T, 3: T}
    return ({1: T}, {1: T}, {1: T}, mask, {1: T})


SMALL = LlamaConfig(dim=64, n_heads=4, n_kv_heads=2, max_seq_len=48)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 1e-2),
                                       (torch.bfloat16, 1e-2)])
def test_llama_attention_block_with_rope_fused_into_q_and_k(dtype, tol):
    block = AttentionBlock(SMALL).eval().to(dtype)
    # a prefill takes its q and k prologues from regions of their own
    # (dispatch/split_attention_prologues.py): kept here to test the fused form
    fused = {"query_prologue_split": False, "key_prologue_split": False}
    exe = kiln.compile(block, block_inputs(SMALL, 8, dtype=dtype),
                       dynamic_shapes=block_dynamic_shapes(SMALL), target="interpret",
                       options=fused)
    region, kernel = _attention_kernel(exe)
    assert kernel.kind == "triton"
    assert kernel.spec.meta["prologue_tiles"] > 0  # RoPE is computed as Q and K load
    assert all(exe.program.kplan.kernels[r.name].kind == "triton" for r in exe.plan.regions
               if r.kind in (RegionKind.MATMUL, RegionKind.ATTENTION))
    with torch.no_grad():
        for t in (8, 1, 21):
            a = block_inputs(SMALL, t, dtype=dtype)
            assert rel_err(exe(*a), block(*a)) <= tol, t


def test_decode_against_a_kv_cache():
    """Prefill writes the cache; decode steps (Tq = 1) read [B, S, Hkv, D] through it."""
    import copy

    block = AttentionBlock(SMALL, ContiguousKVCache(SMALL, 1, torch.float32)).eval()
    eager = copy.deepcopy(block)
    exe = kiln.compile(block, block_inputs(SMALL, 6, cached=True),
                       dynamic_shapes=block_dynamic_shapes(SMALL, cached=True),
                       target="interpret")
    _, kernel = _attention_kernel(exe)
    assert kernel.kind == "triton"
    pos = 0
    with torch.no_grad():
        for t in (6, 1, 1, 3, 1):
            a = block_inputs(SMALL, t, pos, cached=True)
            assert rel_err(exe(*a), eager(*a)) <= 1e-5, (pos, t)
            pos += t


def test_decode_form_packs_the_query_group_into_one_tile():
    """Tq bounded by 1: the default tile is 16 rows (the group's heads), not 128."""
    model = Sdpa()
    q, k, v = _qkv(1, 8, 2, 1, 30)
    S = torch.export.Dim("S_len", min=1, max=64)
    exe = kiln.compile(model, (q, k, v), dynamic_shapes=(None, {2: S}, {2: S}),
                       target="interpret")
    _, kernel = _attention_kernel(exe)
    assert kernel.config["BLOCK_M"] == 16
    for s in (30, 1, 17):
        q, k, v = _qkv(1, 8, 2, 1, s)
        assert rel_err(exe(q, k, v), model(q, k, v)) <= 1e-5


@pytest.mark.parametrize("kv_heads,keys,splits", [(32, 2048, 8), (8, 2304, 16)])
def test_decode_splits_fill_two_programs_an_sm(kv_heads, keys, splits):
    """sm_90 (132 SMs), a decode step over a long cache: 32 KV heads (multi-head
    attention) split their keys 8 ways, two programs an SM (one an SM gave 4 splits,
    each walking 8 of the 32 key blocks in turn); 8 KV heads over kiln bench's 2304
    rows keep one an SM, 16 splits (two an SM gave 18, measured slower)."""
    q, k, v = _qkv(1, 32, kv_heads, 1, keys, d=128, dtype=torch.float16)
    exe = kiln.compile(Sdpa(), (q, k, v), target="cuda:sm_90", options={"tune": "none"})
    _, kernel = _attention_kernel(exe)
    grid = kernel.spec.grid_for({}, kernel.config)
    assert grid[2] == splits, (kernel.spec.grid, kernel.config)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_keys_no_row_lets_through_are_not_read(kind):
    """A decode step over a static cache: the mask lets only the context through, and
    the rest of the cache is never loaded (NaN there changes nothing), in every split."""
    model = Sdpa()
    q, k, v = _qkv(1, 8, 2, 1, 300)
    live = torch.zeros(300, dtype=torch.bool)
    live[:37] = True
    live[200:203] = True  # a live key in a later split
    mask = live.expand(1, 1, 1, 300)
    if kind == "additive":
        mask = torch.zeros(1, 1, 1, 300).masked_fill(~live, float("-inf"))
    exe = kiln.compile(model, (q, k, v, mask), target="interpret")
    region, kernel = _attention_kernel(exe)
    assert kernel.config["KV_SPLIT"] > 1
    kn, vn = k.clone(), v.clone()
    kn[:, :, ~live] = float("nan")
    vn[:, :, ~live] = float("nan")
    out = exe(q, kn, vn, mask)
    assert torch.isfinite(out).all()
    assert rel_err(out, model(q, k, v, mask)) <= 1e-5


class RepeatedKV(torch.nn.Module):
    """GQA written out, as gpt-fast (repeat_interleave) and transformers (repeat_kv:
    expand then reshape) write it, over a boolean mask."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, q, k, v, mask):
        g = q.shape[1] // k.shape[1]
        if self.how == "repeat_interleave":
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        else:
            b, h, s, d = k.shape
            k, v = (x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)
                    for x in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("how", ["repeat_interleave", "expand_reshape"])
def test_repeated_kv_heads_are_read_once_per_group(how):
    """The query heads of a repeated kv head share one tile: K and V are read once."""
    model = RepeatedKV(how)
    for t in (1, 5):  # decode, prefill
        q, k, v = _qkv(2, 8, 2, t, 24)
        mask = torch.rand(t, 24) > 0.3
        mask[:, 0] = True
        exe = kiln.compile(model, (q, k, v, mask), target="interpret")
        _, kernel = _attention_kernel(exe)
        assert kernel.kind == "triton" and kernel.spec.meta["group"] == 4
        assert "kvh = pid_z % 2" in kernel.spec.source
        assert rel_err(exe(q, k, v, mask), model(q, k, v, mask)) <= 1e-5, (how, t)


def test_hopper_leaves_out_the_wgmma_tiles_that_faulted_at_value_dim_16():
    """DeepSeek's tiny test model (head dim 24, value dim 16) faulted on an H100 with a
    one-stage 128-row tile and on an H200 with the two-stage default; no wgmma tile (64
    rows and up) reaches the tuner on sm_90 at that width, the default included."""
    from kiln.codegen.templates.attention import template as attention

    q, k, v = torch.randn(1, 4, 40, 24), torch.randn(1, 4, 40, 24), torch.randn(1, 4, 40, 16)
    exe = kiln.compile(Sdpa(causal=True, gqa=False), (q, k, v), target="cuda:sm_90")
    _, kernel = _attention_kernel(exe)
    configs = kernel.spec.configs
    assert configs and not any(c["BLOCK_M"] >= 64 for c in configs)
    assert kernel.spec.default["BLOCK_M"] == 32 and kernel.spec.default in configs
    shape = attention.analyse(*_region_and_plan(exe))
    assert any(c["BLOCK_M"] >= 64 for c in attention.config_space(shape, None))  # elsewhere
    wider = torch.randn(1, 4, 40, 32)  # a 32-wide value tile keeps its wgmma tiles
    exe = kiln.compile(Sdpa(causal=True, gqa=False), (q, k, wider), target="cuda:sm_90")
    assert any(c["BLOCK_M"] >= 64 for c in _attention_kernel(exe)[1].spec.configs)


def _region_and_plan(exe):
    region, _ = _attention_kernel(exe)
    return region, exe.plan


def test_dropout_is_left_to_the_extern_form():
    class Dropout(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    from kiln.codegen.expr.values import CodegenUnsupported
    from kiln.codegen.templates.attention import template as attention

    plan = kiln.compile(Dropout(), _qkv(1, 2, 2, 4, 4), compile_to="dispatch")
    with pytest.raises(CodegenUnsupported, match="dropout"):
        attention.analyse(plan.regions[0], plan)
    exe = kiln.compile(Dropout(), _qkv(1, 2, 2, 4, 4), target="interpret")
    (region,) = exe.plan.regions
    assert region.notes == ["extern: the attention template declines: SDPA with dropout"]


class ArangeCausal(torch.nn.Module):
    """Two ways models build the causal mask: compare aranges, or torch's own tril."""

    def __init__(self, tril: bool):
        super().__init__()
        self.tril = tril

    def forward(self, q, k, v):
        t, s = q.shape[2], k.shape[2]
        if self.tril:
            mask = torch.ones(t, s, dtype=torch.bool).tril()
        else:
            mask = torch.arange(s)[None, :] <= torch.arange(t)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize("tril", [False, True])
def test_mask_built_from_aranges_is_recognised_as_causal(tril):
    model = ArangeCausal(tril)
    q, k, v = _qkv(1, 4, 2, 12, 12)
    exe = kiln.compile(model, (q, k, v), target="interpret")
    _, kernel = _attention_kernel(exe)
    assert kernel.spec.meta["causal"] and kernel.spec.meta["mask"] is None
    assert rel_err(exe(q, k, v), model(q, k, v)) <= 1e-5


def test_a_shifted_mask_is_not_mistaken_for_causal():
    class Shifted(torch.nn.Module):
        def forward(self, q, k, v):
            mask = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None] + 2
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = _qkv(1, 2, 2, 6, 9)
    exe = kiln.compile(Shifted(), (q, k, v), target="interpret")
    _, kernel = _attention_kernel(exe)
    assert not kernel.spec.meta["causal"] and kernel.spec.meta["mask"] == "bool"
    assert rel_err(exe(q, k, v), Shifted()(q, k, v)) <= 1e-5


def test_head_dim_that_is_not_a_power_of_two():
    model = Sdpa(causal=True)
    q, k, v = _qkv(1, 2, 1, 7, 7, d=24)  # tiles of 32, the last 8 lanes masked
    exe = kiln.compile(model, (q, k, v), target="interpret")
    assert _attention_kernel(exe)[1].spec.meta["head_dim_pad"] == 32
    assert rel_err(exe(q, k, v), model(q, k, v)) <= 1e-5


@pytest.mark.parametrize("head_dim,dtype,target", [
    (64, torch.float16, "cuda:sm_90"), (128, torch.bfloat16, "cuda:sm_80"),
    (256, torch.float16, "rocm:gfx942"), (256, torch.bfloat16, "cuda:sm_90")])
def test_llm_head_dims_compile_within_the_target(head_dim, dtype, target):
    """Head dims 64..256 build for real GPUs (compile-only) at a config that fits."""
    from kiln.codegen.build.compiler import compile_binary
    from kiln.codegen.build.resources import fitted_spec
    from kiln.codegen.templates.attention import template as attention
    from kiln.target import get_target

    S = torch.export.Dim("S_len", min=1, max=8192)
    args = _qkv(1, 32, 8, 16, 16, d=head_dim, dtype=dtype)
    plan = kiln.compile(Sdpa(causal=True), args, dynamic_shapes=({2: S}, {2: S}, {2: S}),
                        compile_to="dispatch")
    tgt = get_target(target)
    spec = fitted_spec(plan.regions[0], plan, tgt, attention.generate)
    res = compile_binary(spec, spec.default, tgt).resources
    assert res.shared <= tgt.shared_mem_per_block and res.spills == 0, (spec.default, res)


def test_split_keys_merge_keeps_the_size_named_s0():
    """A dynamic query length (export's first symbol, s0: a kernel parameter) with keys
    split: the merge loop's counter once shadowed s0, and the store after it wrote rows
    at the counter's value (rel. error ~1e3)."""
    model = Sdpa()
    exe = kiln.compile(model, _qkv(1, 4, 2, 8, 150), dynamic_shapes=({2: L}, None, None),
                       target="interpret")
    _, kernel = _attention_kernel(exe)
    assert "s0" in kernel.spec.source and kernel.config["KV_SPLIT"] > 1
    for t in (8, 30):
        args = _qkv(1, 4, 2, t, 150)
        assert rel_err(exe(*args), model(*args)) <= 1e-5, t
