"""The resource model and resource-driven splitting, checked against real compile-only
builds (no GPU needed): estimates track Triton's figures, nothing over a target's limit
is ever chosen, and a fused region that cannot fit is split (DESIGN.md failure 1)."""

import dataclasses
import os
import time

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.codegen.autotune.candidates import candidates
from kiln.codegen.autotune.worker_pool import OK, Job, get_pool
from kiln.codegen.build import resources
from kiln.codegen.build.compiler import Resources, compile_binary
from kiln.codegen.build.resources import precheck
from kiln.codegen.build.spec import Config
from kiln.codegen.select_kernels import TEMPLATES
from kiln.codegen.templates.attention import template as attention
from kiln.codegen.templates.matmul import template as matmul
from kiln.ir.plan import RegionKind
from kiln.models.llama import PRESETS, apply_rope
from kiln.target import get_target
from tests.codegen.test_attention import AttentionBlock, block_dynamic_shapes, block_inputs
from tests.dispatch.test_split import Block, _plan


def _spec(model, args, kind, dynamic_shapes=None):
    plan = kiln.compile(model, args, dynamic_shapes=dynamic_shapes, compile_to="dispatch")
    region = next(r for r in plan.regions if r.kind == kind)
    gen = attention.generate if kind == RegionKind.ATTENTION else matmul.generate
    return gen(region, plan, get_target("cuda:sm_90"))


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(512, 256, bias=False)

    def forward(self, x):
        return self.lin(x)


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


T = torch.export.Dim("T", min=1, max=4096)
CASES = [  # (target, template, config): wgmma / mma.sync / MFMA, several stage counts
    ("cuda:sm_90", "matmul", Config.make(8, 3, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
                                         SPLIT_K=8)),
    ("cuda:sm_80", "matmul", Config.make(4, 4, BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8,
                                         SPLIT_K=1)),
    ("rocm:gfx942", "matmul", Config.make(4, 3, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8,
                                          SPLIT_K=8)),
    ("cuda:sm_90", "attention", Config.make(8, 2, BLOCK_M=128, BLOCK_N=64, KV_SPLIT=32)),
    ("cuda:sm_80", "attention", Config.make(4, 2, BLOCK_M=16, BLOCK_N=64, KV_SPLIT=32)),
    ("rocm:gfx942", "attention", Config.make(4, 2, BLOCK_M=64, BLOCK_N=32, KV_SPLIT=1)),
]


@pytest.fixture(scope="module")
def specs():
    h = torch.float16
    lin = _spec(Linear().to(h), (torch.randn(1, 32, 512, dtype=h),), RegionKind.MATMUL,
                ({1: T},))
    qkv = (torch.randn(1, 8, 32, 128, dtype=h), torch.randn(1, 2, 32, 128, dtype=h),
           torch.randn(1, 2, 32, 128, dtype=h))
    att = _spec(Sdpa(), qkv, RegionKind.ATTENTION, ({2: T}, {2: T}, {2: T}))
    return {"matmul": lin, "attention": att}


@pytest.mark.parametrize("target,template,config", CASES)
def test_estimate_tracks_the_compiled_figures(specs, target, template, config):
    spec, tgt = specs[template], get_target(target)
    est = resources.estimate(spec, config, tgt)
    real = compile_binary(spec, config, tgt).resources
    assert 0.9 * real.shared <= est.shared <= 1.5 * real.shared, resources.compare(est, real)
    assert est.threads == real.threads == config.num_warps * tgt.warp_size
    assert real.registers is not None and 0.4 * real.registers <= est.registers <= 2.5 * max(
        real.registers, 64), resources.compare(est, real)


def test_violations_name_each_limit():
    gfx = get_target("rocm:gfx942")
    assert resources.fits(Resources(65536, 128, 0, 256), gfx)
    over = resources.violations(Resources(65537, 600, 0, 2048), gfx)
    assert "needs 65537 B of shared memory, the target has 65536 B" in over
    assert "needs 600 registers per thread, the target has 512" in over
    assert "needs 2048 threads per block, the target allows 1024" in over
    assert resources.over_limits(Resources(65537, None, 0, 256), gfx) == over[0]


def test_configs_over_the_limit_are_pruned_before_compiling(specs):
    spec, gfx = specs["matmul"], get_target("rocm:gfx942")
    chosen = resources.fitted_spec(None, None, gfx, lambda *_: spec)
    assert chosen.configs and len(chosen.configs) < len(spec.configs)
    assert all(resources.estimate(chosen, c, gfx).shared <= gfx.shared_mem_per_block
               for c in chosen.configs)
    assert chosen.default in chosen.configs


def _stages2(gen):
    """The generator, limited to two-stage 16x16 tiles: every config pipelines its loads."""
    def restricted(region, plan, target):
        spec = gen(region, plan, target)
        only = Config.make(4, 2, BLOCK_M=16, BLOCK_N=16, KV_SPLIT=1)
        return dataclasses.replace(spec, configs=[only], default=only)
    return restricted


def test_attention_that_cannot_fit_is_split_and_then_fits():
    """RoPE fused into K is staged with K by the pipeline: on a target whose shared memory
    lies between the fused and the unfused kernel's needs, the prologue comes out."""
    base = get_target("cuda:sm_80")
    model = Block()
    gen = _stages2(attention.generate)
    plan = _plan(model)
    region = next(r for r in plan.regions if r.kind == RegionKind.ATTENTION)
    only = Config.make(4, 2, BLOCK_M=16, BLOCK_N=16, KV_SPLIT=1)
    fused = compile_binary(gen(region, plan, base), only,
                           base).resources.shared
    split_plan = _plan(model)
    split_region = next(r for r in split_plan.regions if r.kind == RegionKind.ATTENTION)
    from kiln.dispatch import split
    for o in split.splittable_operands(split_region):
        split.split_prologue(split_plan, split_region, o, "measure")
    unfused = compile_binary(gen(split_region, split_plan, base),
                             only, base).resources.shared
    assert fused > unfused
    tight = dataclasses.replace(base, name="cuda:sm_80-tight",
                                shared_mem_per_block=(fused + unfused) // 2)
    spec = resources.fitted_spec(region, plan, tight, gen)
    assert spec is not None
    assert compile_binary(spec, spec.default, tight).resources.shared <= (fused + unfused) // 2
    key = next(r for r in plan.regions if r.name == f"{region.name}_key")
    note = next(n for n in region.notes if n.startswith("split:"))
    assert "key" in note and f"needs {fused} B of shared memory" in note
    assert str(tight.shared_mem_per_block) in note and any("split from" in n for n in key.notes)


def test_nothing_to_split_runs_extern_with_the_reason():
    tiny = dataclasses.replace(get_target("cuda:sm_80"), name="tiny", shared_mem_per_block=64)
    h = torch.float16
    plan = kiln.compile(Linear().to(h), (torch.randn(1, 32, 512, dtype=h),),
                        compile_to="dispatch")
    (region,) = plan.regions
    assert resources.fitted_spec(region, plan, tiny, matmul.generate) is None
    assert len(plan.regions) == 1  # a matmul's operands are views: nothing to split off
    (note,) = region.notes
    assert note.startswith("extern:") and "B of shared memory, the target has 64 B" in note


@pytest.fixture(scope="module")
def llama3_8b_attention():
    """The seed case: Llama-3-8B's attention block (head dim 128, fp16, GQA 32/8) with
    RoPE fused into attention's Q and K; weights on the meta device (no memory)."""
    cfg = PRESETS["llama3-8b"]
    with torch.device("meta"):
        block = AttentionBlock(cfg).to(torch.float16)
    cfg16 = cfg.with_(max_seq_len=64)  # the example's RoPE tables; the dim's bound is cfg's
    args = tuple(a.to("meta") for a in block_inputs(cfg16, 16, dtype=torch.float16))
    return block, args, block_dynamic_shapes(cfg)


@pytest.mark.parametrize("target", ["rocm:gfx942", "cuda:sm_80", "cuda:sm_90"])
def test_llama3_8b_attention_block_fits_every_target(llama3_8b_attention, target):
    model, args, ds = llama3_8b_attention
    tgt = get_target(target)
    kp = kiln.compile(model, args, dynamic_shapes=ds, target=target, compile_to="codegen",
                      options={"tune": "none"})
    regions = kp.plan.regions
    attn = [r for r in regions if r.kind == RegionKind.ATTENTION]
    assert len(attn) == 1
    split_happened = any(n.startswith("split:") for n in attn[0].notes)
    if not split_happened:  # RoPE stayed fused: attention computes it as it loads
        assert attn[0].notes and kp.kernels[attn[0].name].spec.meta["prologue_tiles"] > 0
    for r in regions:
        kernel = kp.kernels[r.name]
        if r.kind in (RegionKind.MATMUL, RegionKind.ATTENTION):
            assert kernel.kind == "triton", (r.name, r.notes)
        if kernel.kind == "triton":
            res = kernel.binary.resources
            assert res.shared <= tgt.shared_mem_per_block, (r.name, res)
            assert resources.fits(res, tgt), resources.violations(res, tgt)


GPU_TARGETS = ("rocm:gfx942", "cuda:sm_80", "cuda:sm_90")


def _what_tuning_compiles(model, args, ds, target, mode):
    """The attention kernel's configs that tuning in `mode` would compile for `target`:
    the spec after fitting (and any split), as select_kernels makes it, less the configs
    the pre-compile check rules out. Mirrors select_kernels.kernel_for, Tuner._compile."""
    tgt = get_target(target)
    plan = kiln.compile(model, args, dynamic_shapes=ds, target=target, compile_to="dispatch")
    region = next(r for r in plan.regions if r.kind == RegionKind.ATTENTION)
    spec = resources.fitted_spec(region, plan, tgt, TEMPLATES[RegionKind.ATTENTION])
    assert spec is not None, region.notes
    configs = [c for c in candidates(spec, mode) if precheck(spec, c, tgt) is None]
    return spec, configs


@pytest.mark.parametrize("mode", ["fast", pytest.param("full", marks=pytest.mark.slow)])
def test_every_config_tuning_may_pick_fits_the_llama3_8b_attention(llama3_8b_attention, mode):
    """Not just the default: every attention config the tuner would compile (mode "fast",
    the default, or "full") is compiled, compile-only and in the tuner's worker pool, for
    every GPU target, and the binary's real shared memory (Triton's metadata.shared) is
    within the target's limit. fast: ~20 compiles; full: ~260, minutes on 2 cores."""
    model, args, ds = llama3_8b_attention
    jobs = []
    for target in GPU_TARGETS:
        spec, configs = _what_tuning_compiles(model, args, ds, target, mode)
        assert spec.default in configs, target
        assert len(configs) == len(candidates(spec, mode)) > (20 if mode == "full" else 2)
        jobs += [Job(spec, c, get_target(target), "kiln.codegen.build.compiler:compile_binary")
                 for c in configs]
    start = time.perf_counter()
    over, failed = [], []
    for i, out in get_pool(os.cpu_count() or 2).run(jobs, timeout=600):
        job = jobs[i]
        if out.status != OK:
            failed.append(f"{job.target.name} [{job.config}]: {out.status}: {out.reason}")
            continue
        res = out.binary.resources
        if res.shared > job.target.shared_mem_per_block or not resources.fits(res, job.target):
            over.append(f"{job.target.name} [{job.config}]: {res.shared} B shared, "
                        f"{resources.violations(res, job.target)}")
    print(f"{len(jobs)} attention configs ({mode}) compiled in "
          f"{time.perf_counter() - start:.0f} s")
    assert not failed, "configs the tuner would try do not compile:\n" + "\n".join(failed)
    assert not over, "configs the tuner may pick are over the target:\n" + "\n".join(over)


class RopeSdpa(torch.nn.Module):
    """RoPE on Q and K, then causal GQA attention: the pattern fuses RoPE into attention."""

    def forward(self, q, k, v, cos, sin):
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True,
                                              enable_gqa=True)


def test_kiln_compile_splits_attention_that_cannot_fit_and_explain_says_why():
    """Through kiln.compile, not fitted_spec: gfx942 with its LDS cut below the smallest
    attention config (the real 64 KiB needs a head dim of 2048 in fp32 to overflow,
    minutes of compiling). Both RoPE prologues come out into regions of their own, in
    split order (key first); the attention then runs extern, and explain names it all."""
    lds = get_target("rocm:gfx942")
    tight = dataclasses.replace(lds, name="rocm:gfx942-512B-lds", shared_mem_per_block=512)
    q, k, v = torch.randn(1, 8, 4, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    cos, sin = torch.randn(1, 8, 1, 16), torch.randn(1, 8, 1, 16)
    unsplit = kiln.compile(RopeSdpa(), (q, k, v, cos, sin), compile_to="dispatch")
    (attn,) = [r for r in unsplit.regions if r.kind == RegionKind.ATTENTION]
    assert len(unsplit.regions) == 1, [r.name for r in unsplit.regions]  # RoPE is fused

    cm = kiln.compile(RopeSdpa(), (q, k, v, cos, sin), target=tight, options={"tune": "none"})
    regions = {r.name: r for r in cm.plan.regions}
    assert list(regions) == [f"{attn.name}_key", f"{attn.name}_query", attn.name]
    notes = regions[attn.name].notes
    heads = ("split: the key's prologue", "split: the query's prologue", f"extern: on {tight}")
    assert len(notes) == 3 and all(n.startswith(h) for n, h in zip(notes, heads)), notes
    assert f"moved to region {attn.name}_key: on {tight}" in notes[0]
    assert "B of shared memory, the target has 512 B" in notes[0]
    for part in ("key", "query"):
        assert regions[f"{attn.name}_{part}"].kind == RegionKind.POINTWISE
        assert regions[f"{attn.name}_{part}"].notes[0].startswith(
            f"split from region {attn.name} (the {part}'s prologue)")
    report = cm.explain()
    assert f"3 regions for {tight}" in report
    for n in notes:
        assert f"  note: {n}" in report
    assert f"{attn.name}_key pointwise" in report and f"{attn.name}_query pointwise" in report
