"""Split reductions under Triton's interpreter: K split across programs for the GEMV and
tiled matmul forms, keys split for attention; the last program to arrive combines the
parts. Each forced split is compared with eager PyTorch on the same inputs, and must
really split (grid axis 2 > 1), leave its counters zero and be deterministic."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.build.spec import Config, KernelSpec, Scratch
from kiln.codegen.build.triton_kernel import TritonKernel, scratch_buffer
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.attention import template as attention
from kiln.codegen.templates.matmul import template as matmul
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import RegionKind
from kiln.target import get_target
from tests.helpers import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


class Linear(torch.nn.Module):
    """addmm + relu + per-column scale: an epilogue the last program alone runs."""

    def __init__(self, k, n):
        super().__init__()
        self.lin = torch.nn.Linear(k, n)
        self.scale = torch.nn.Parameter(torch.randn(n))

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.scale


class Bmm(torch.nn.Module):
    def forward(self, a, b):
        return torch.bmm(a, b.transpose(1, 2))


class Sdpa(torch.nn.Module):
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal,
                                              enable_gqa=True)


def _kernel(model, args, **params):
    """The region's generated kernel at its default config with `params` forced, and
    random inputs for it (masks random too)."""
    plan = kiln.compile(model, args, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind in (RegionKind.MATMUL,
                                                        RegionKind.ATTENTION)]
    gen = matmul.generate if region.kind == RegionKind.MATMUL else attention.generate
    spec = gen(region, plan, get_target("interpret"))
    d = spec.default
    warps, stages = params.pop("warps", d.num_warps), params.pop("stages", d.num_stages)
    config = Config.make(warps, stages, **{**d.as_dict(), **params})
    inputs = {}
    for v in region.inputs:
        tv = plan.values[v]
        shape = tuple(int(x) for x in tv.shape)
        inputs[v] = (torch.rand(shape) > 0.4 if tv.dtype == torch.bool
                     else torch.randn(shape, dtype=tv.dtype))
    return region, plan, TritonKernel(region, spec, config, interpret=True), inputs


def _run(region, plan, kernel, inputs):
    outs = {o: torch.full(tuple(int(x) for x in plan.values[o].shape), float("nan"),
                          dtype=plan.values[o].dtype) for o in region.outputs}
    kernel.run(inputs, outs, {})
    return outs


def _check(model, args, splits_at_least=2, **params):
    region, plan, kernel, inputs = _kernel(model, args, **params)
    assert kernel.spec.grid_for(kernel.sizes({}), kernel.config)[2] >= splits_at_least
    ref = {o: torch.empty(tuple(int(x) for x in plan.values[o].shape),
                          dtype=plan.values[o].dtype) for o in region.outputs}
    TorchKernel(region, "cpu").run(inputs, ref, {})
    first = _run(region, plan, kernel, inputs)
    again = _run(region, plan, kernel, inputs)
    for o in region.outputs:
        assert rel_err(first[o], ref[o]) <= TOL[ref[o].dtype], (o, rel_err(first[o], ref[o]))
        assert torch.equal(first[o], again[o])  # the parts are summed in split order
    if kernel.config.as_dict().get("SPLIT_K", kernel.config.as_dict().get("KV_SPLIT")) > 1:
        counts = scratch_buffer(kernel.spec.scratch[1], 1, 1, "cpu")
        assert counts.dtype == torch.int32 and not counts.any()  # zero for the next launch
    return kernel


# a static row; padded rows and a K tail (bf16: one row, its GEMV's most)
@pytest.mark.parametrize("dtype,rows,k", [(torch.float32, 1, 256), (torch.float32, 3, 200),
                                          (torch.bfloat16, 1, 256), (torch.bfloat16, 1, 200)])
def test_gemv_split_k_matches_eager(dtype, rows, k):
    model = Linear(k, 48).to(dtype)
    kernel = _check(model, (torch.randn(1, rows, k, dtype=dtype),), BLOCK_N=16, BLOCK_K=32,
                    SPLIT_K=4)
    assert kernel.spec.meta["form"] == "gemv"


@pytest.mark.parametrize("k", [256, 200])
def test_tiled_split_k_matches_eager(k):
    model = Linear(k, 48)
    kernel = _check(model, (torch.randn(1, 37, k),), BLOCK_M=16, BLOCK_N=16, BLOCK_K=32,
                    SPLIT_K=4)
    assert kernel.spec.meta["form"] == "tiled"


def test_batched_tiled_split_k_keeps_batches_apart():
    _check(Bmm(), (torch.randn(3, 20, 256), torch.randn(3, 24, 256)), BLOCK_M=16,
           BLOCK_N=16, BLOCK_K=32, SPLIT_K=8)


def test_split_cap_of_one_launches_one_program_per_tile():
    _check(Linear(256, 48), (torch.randn(1, 2, 256),), splits_at_least=1, BLOCK_N=16,
           BLOCK_K=32, SPLIT_K=1)


@pytest.mark.parametrize("kind", ["bool", "add"])
def test_decode_attention_split_over_the_cache_matches_eager(kind):
    q, k, v = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 200, 16), torch.randn(1, 2, 200, 16)
    mask = torch.rand(1, 200) > 0.3 if kind == "bool" else torch.randn(1, 8, 1, 200)
    _check(Sdpa(), (q, k, v, mask), BLOCK_M=16, BLOCK_N=16, KV_SPLIT=8)


def test_decode_attention_with_whole_splits_masked_out():
    """Keys 0..149 masked: early splits see only -inf scores and merge as empty."""
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 1, 200, 16), torch.randn(1, 1, 200, 16)
    region, plan, kernel, inputs = _kernel(Sdpa(), (q, k, v, torch.ones(1, 200, dtype=bool)),
                                           BLOCK_M=16, BLOCK_N=16, KV_SPLIT=8)
    mask_name = next(n for n, t in inputs.items() if t.dtype == torch.bool)
    inputs[mask_name] = torch.arange(200)[None, :] >= 150
    ref = {o: torch.empty(1, 4, 1, 16) for o in region.outputs}
    TorchKernel(region, "cpu").run(inputs, ref, {})
    out = _run(region, plan, kernel, inputs)
    assert all(rel_err(out[o], ref[o]) <= 1e-5 for o in region.outputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_causal_prefill_attention_split_matches_eager(dtype):
    q, k, v = (torch.randn(1, 4, 37, 16, dtype=dtype), torch.randn(1, 2, 37, 16, dtype=dtype),
               torch.randn(1, 2, 37, 16, dtype=dtype))
    _check(Sdpa(causal=True), (q, k, v), BLOCK_M=16, BLOCK_N=16, KV_SPLIT=4)


def test_scratch_buffers_are_shared_grow_and_keep_the_old_alive():
    from kiln.codegen.build import triton_kernel as kernel_module

    b = Scratch("buf", torch.float32, "n", zeroed=True)
    first = scratch_buffer(b, 7, 10, "cpu")
    assert first.numel() == 10 and not first.any()
    assert scratch_buffer(b, 7, 5, "cpu") is first  # big enough: shared
    bigger = scratch_buffer(b, 7, 20, "cpu")
    assert bigger.numel() == 20 and bigger is not first
    kept = kernel_module._SCRATCH[("cpu", torch.float32, True, 7)]
    assert kept[0] is first  # a captured CUDA graph may still point at it


def test_scratch_sizes_follow_the_launch_and_survive_json():
    region, plan, kernel, inputs = _kernel(Linear(256, 48), (torch.randn(1, 1, 256),),
                                           BLOCK_N=16, BLOCK_K=32, SPLIT_K=4)
    spec = kernel.spec
    parts, counts = spec.scratch
    assert (parts.name, counts.name) == (split.PARTS, split.COUNTS) and counts.zeroed
    config = kernel.config
    assert parts.numel_for({}, config) == 3 * 4 * 16  # tiles x splits x (rows x BLOCK_N)
    assert counts.numel_for({}, config) == 3
    one = dataclasses.replace(config, params=tuple(
        (k, 1 if k == "SPLIT_K" else v) for k, v in config.params))
    assert parts.numel_for({}, one) == 1  # no split, no parts
    again = KernelSpec.from_json(spec.to_json())
    assert again.scratch == spec.scratch and again.signature() == spec.signature()
    assert spec.signature()[split.COUNTS] == "*i32"
    n = len(spec.args)  # the scratch pointers follow the arguments (16-byte aligned)
    assert spec.pointer_indices()[-2:] == [n, n + 1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_forms_on_the_gpu_match_torch_at_every_launch(dtype):
    """The interpreter runs programs one by one; on the GPU the parts race to the counter.
    Fresh inputs and a poisoned output every launch: a missing barrier or fence shows as
    an error that moves from launch to launch."""
    from kiln.codegen.build.compiler import compile_binary
    from kiln.target import detect_cuda

    h = dtype
    cases = [  # (model, args, forced config): each splits into several parts
        (Linear(4096, 1024).to(h), (torch.randn(1, 2, 4096, dtype=h),),
         dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=16, warps=4, stages=1)),
        (Linear(4096, 1024).to(h), (torch.randn(1, 256, 4096, dtype=h),),
         dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, SPLIT_K=8, warps=8, stages=3)),
        (Sdpa(), (torch.randn(1, 32, 1, 128, dtype=h), torch.randn(1, 8, 2048, 128, dtype=h),
                  torch.randn(1, 8, 2048, 128, dtype=h), torch.rand(1, 2048) > 0.2),
         dict(BLOCK_M=16, BLOCK_N=64, KV_SPLIT=32, warps=4, stages=2)),
    ]
    target = detect_cuda()
    for model, args, params in cases:
        region, plan, interpreted, _ = _kernel(model, args, **params)
        spec = (matmul.generate if region.kind == RegionKind.MATMUL else attention.generate)(
            region, plan, target)
        kernel = TritonKernel(region, spec, interpreted.config,
                              compile_binary(spec, interpreted.config, target))
        shapes = {v: (tuple(int(x) for x in plan.values[v].shape), plan.values[v].dtype)
                  for v in [*region.inputs, *region.outputs]}
        assert spec.grid_for({}, kernel.config)[2] > 1  # static sizes: no size arguments
        for _ in range(20):
            inputs = {v: (torch.rand(s, device="cuda") > 0.2 if d == torch.bool
                          else torch.randn(s, dtype=d, device="cuda") * 0.05)
                      for v, (s, d) in shapes.items() if v in region.inputs}
            outs = {o: torch.full(shapes[o][0], float("nan"), dtype=shapes[o][1],
                                  device="cuda") for o in region.outputs}
            ref = {o: torch.empty_like(t) for o, t in outs.items()}
            kernel.run(inputs, outs, {})
            TorchKernel(region, "cuda").run(inputs, ref, {})
            for o in region.outputs:
                assert rel_err(outs[o].float(), ref[o].float()) <= 1e-2, spec.name


class PrefixOverCache(torch.nn.Module):
    """kiln.models' prompt attention: each row passes the cache's keys up to its position
    (the last `window` of them with a window: the span starts past key 0)."""

    def __init__(self, window=None):
        super().__init__()
        self.window = window

    def forward(self, q, k_cache, v_cache, input_pos):
        kv, pos = torch.arange(k_cache.shape[2])[None, :], input_pos[:, None]
        mask = kv <= pos
        if self.window is not None:
            mask = mask & (kv > pos - self.window)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask[None, None],
                                              enable_gqa=True)


@pytest.mark.parametrize("window", [None, 200])
def test_prompt_split_narrows_to_the_keys_its_rows_reach(window):
    """The launch splits a prompt tile by the cache's 1024 slots (8 parts of 128 keys);
    the rows reach 24, 324 or 1024 of them, so 1, 3 or all 8 parts are live (the rest
    leave at once, one live part stores its output itself); a 200-key window starts the
    span past key 0 (2 or 3 parts from there). One module, every reach, against eager;
    the counters are zero after each call."""
    q, kc, vc = torch.randn(1, 4, 24, 16), torch.randn(1, 2, 1024, 16), torch.randn(1, 2, 1024, 16)
    model = PrefixOverCache(window)
    exe = kiln.compile(model, (q, kc, vc, torch.arange(24)), target="interpret")
    (region,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    kernel = exe.program.kplan.kernels[region.name]
    assert "n_live" in kernel.spec.source and kernel.config["KV_SPLIT"] > 1
    assert kernel.spec.grid_for(kernel.sizes({}), kernel.config)[2] == 8
    for start in (0, 300, 1000):
        pos = torch.arange(start, start + 24)
        assert rel_err(exe(q, kc, vc, pos), model(q, kc, vc, pos)) <= 1e-5, start
        counts = scratch_buffer(kernel.spec.scratch[1], 1, 1, "cpu")
        assert not counts.any()


class BatchPrefix(torch.nn.Module):
    """Each sequence of a batch its own positions ([B, T]): its own envelope a tile."""

    def forward(self, q, k_cache, v_cache, input_pos):
        mask = torch.arange(k_cache.shape[2])[None, None, :] <= input_pos[:, :, None]
        return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask[:, None],
                                              enable_gqa=True)


def test_prompt_split_counts_live_parts_per_sequence():
    """Two sequences at different depths of one 1024-slot cache: one tile's rows reach
    24 keys (1 live part), the other's 1000 (8): each tile counts its own."""
    q = torch.randn(2, 4, 24, 16)
    kc, vc = torch.randn(2, 2, 1024, 16), torch.randn(2, 2, 1024, 16)
    model = BatchPrefix()
    pos = torch.stack([torch.arange(24), torch.arange(976, 1000)])
    exe = kiln.compile(model, (q, kc, vc, pos), target="interpret")
    (region,) = [r for r in exe.plan.regions if r.kind == RegionKind.ATTENTION]
    assert "n_live" in exe.program.kplan.kernels[region.name].spec.source
    for p in (pos, pos.flip(0)):
        assert rel_err(exe(q, kc, vc, p), model(q, kc, vc, p)) <= 1e-5
