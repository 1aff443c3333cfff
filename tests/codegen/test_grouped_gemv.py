"""Sibling decode GEMVs in one kernel (dispatch/group_siblings.py, templates/matmul/
grouped.py, the paired GEMV): HF-style Llama attention and MLP blocks at decode under
Triton's interpreter and on the CPU target against eager (fp32 1e-5, bf16 1e-2), a
dynamic batch of 1..4 rows, forced K splits, groups the template declines split apart,
and the grouped kernel compiled for sm_90 without a GPU."""

import re

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary, disassemble
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.matmul import grouped
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import RegionKind
from kiln.target import get_target
from tests.dispatch.test_group_siblings import (
    MLP,
    Attention,
    GateAlsoReturned,
    RawWeights,
    products,
)
from tests.helpers import assert_close_tree, rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
BATCH = torch.export.Dim("B", min=1, max=4)


def _grouped_kernels(exe):
    out = []
    for r in exe.plan.regions:
        if r.kind == RegionKind.MATMUL and len(products(r)) > 1:
            k = exe.program.kplan.kernels[r.name]
            assert isinstance(k, TritonKernel), r.notes
            out.append(k)
    return out


@DTYPES
@pytest.mark.parametrize("block,bias", [(Attention, False), (Attention, True), (MLP, False)])
def test_llama_blocks_at_decode_batches_1_to_4(dtype, block, bias):
    """fp32 products of up to 4 rows are GEMVs and group; bf16 ones of more than one row
    take the tiled tensor-core form (fold_rmsnorm.gemv_max_rows) and stay apart."""
    model = (block(bias=bias) if bias else block()).to(dtype).eval()
    exe = kiln.compile(model, (torch.randn(2, 1, 64, dtype=dtype),), target="interpret",
                       dynamic_shapes=({0: BATCH},))
    if dtype == torch.float32:
        (k,) = _grouped_kernels(exe)
        assert len(k.spec.meta["siblings"]) == (3 if block is Attention else 2)
        assert "note: siblings: " in exe.explain()
    else:
        assert not _grouped_kernels(exe)
    with torch.no_grad():
        for b in (1, 3, 4):
            x = torch.randn(b, 1, 64, dtype=dtype)
            assert_close_tree(exe(x), model(x), TOL[dtype])


def test_cpu_target_matches_eager():
    for model in (Attention(bias=True), MLP()):
        exe = kiln.compile(model, (torch.randn(2, 1, 64),), target="cpu",
                           dynamic_shapes=({0: BATCH},))
        with torch.no_grad():
            for b in (1, 4):
                x = torch.randn(b, 1, 64)
                assert_close_tree(exe(x), model(x), 1e-5)


def test_odd_siblings_stay_apart_and_match():
    """A gate product also returned is not absorbed; [K, N] weights read by different
    index maps are grouped, declined by the grouped GEMV and split apart: each a GEMV."""
    for model in (GateAlsoReturned(), RawWeights()):
        exe = kiln.compile(model, (torch.randn(1, 1, 64),), target="interpret")
        assert not _grouped_kernels(exe)
        assert all(isinstance(exe.program.kplan.kernels[r.name], TritonKernel)
                   for r in exe.plan.regions if r.kind == RegionKind.MATMUL)
        with torch.no_grad():
            x = torch.randn(1, 1, 64)
            assert_close_tree(exe(x), model(x), 1e-5)
    notes = [n for r in exe.plan.regions for n in r.notes]
    assert any("siblings apart: the grouped GEMV declines" in n for n in notes), notes


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 3), (torch.bfloat16, 1)])
def test_forced_k_splits_of_the_grouped_gemv(dtype, rows):
    """Each program's split parts go to its global column block's scratch slot."""
    model = Attention(dim=256, heads=4, kv_heads=2, bias=True).to(dtype)
    plan = kiln.compile(model, (torch.randn(rows, 1, 256, dtype=dtype),),
                        target="interpret", compile_to="dispatch")
    (region,) = [r for r in plan.regions if len(products(r)) > 1]
    spec = grouped.generate(region, plan, get_target("interpret"))
    config = Config.make(2, 1, BLOCK_N=32, BLOCK_K=32, SPLIT_K=4)
    kernel = TritonKernel(region, spec, config, interpret=True)
    assert spec.grid_for(kernel.sizes({}), config)[2] == 4
    inputs = {v: torch.randn(tuple(plan.values[v].shape), dtype=plan.values[v].dtype)
              for v in region.inputs}
    outs = {o: (tuple(plan.values[o].shape), plan.values[o].dtype) for o in region.outputs}
    ref = {o: torch.empty(s, dtype=d) for o, (s, d) in outs.items()}
    got = {o: torch.empty(s, dtype=d) for o, (s, d) in outs.items()}
    TorchKernel(region, "cpu").run(inputs, ref, {})
    kernel.run(inputs, got, {})
    for o in region.outputs:
        assert rel_err(got[o], ref[o]) <= TOL[dtype], (o, rel_err(got[o], ref[o]))


class RouterAndGate(torch.nn.Module):
    """Qwen3-Next's router [E, D] and shared expert gate [1, D] of one normed x."""

    def __init__(self, dim=64, experts=24):
        super().__init__()
        self.router = torch.nn.Linear(dim, experts, bias=False)
        self.gate = torch.nn.Linear(dim, 1, bias=False)

    def forward(self, x):
        return self.router(x).softmax(-1), torch.sigmoid(self.gate(x))


@DTYPES
def test_a_single_column_sibling_is_grouped(dtype):
    """The [1, D] gate reads its one column at a constant; grouped with the router it
    reads through the router's index map at column 0 (nj = 1), with K split too."""
    model = RouterAndGate().to(dtype)
    # bf16 groups one row only (more take the tiled form: fold_rmsnorm.gemv_max_rows)
    rows = 3 if dtype == torch.float32 else 1
    exe = kiln.compile(model, (torch.randn(min(rows, 2), 1, 64, dtype=dtype),),
                       target="interpret",
                       dynamic_shapes=({0: BATCH},) if rows > 1 else None)
    (k,) = _grouped_kernels(exe)
    assert len(k.spec.meta["siblings"]) == 2
    region = k.region
    config = Config.make(2, 1, BLOCK_N=16, BLOCK_K=16, SPLIT_K=4)
    forced = TritonKernel(region, k.spec, config, interpret=True)
    with torch.no_grad():
        for b in sorted({1, rows}):
            x = torch.randn(b, 1, 64, dtype=dtype)
            assert_close_tree(exe(x), model(x), TOL[dtype])
        plan = exe.plan
        env = {str(s): rows for s in plan.symbols}
        inputs = {v: torch.randn(_sized(plan.values[v].shape, env),
                                 dtype=plan.values[v].dtype) for v in region.inputs}
        outs = {o: (_sized(plan.values[o].shape, env), plan.values[o].dtype)
                for o in region.outputs}
        ref = {o: torch.empty(s, dtype=d) for o, (s, d) in outs.items()}
        got = {o: torch.empty(s, dtype=d) for o, (s, d) in outs.items()}
        TorchKernel(region, "cpu").run(inputs, ref, env)
        forced.run(inputs, got, env)
    for o in region.outputs:
        assert rel_err(got[o], ref[o]) <= TOL[dtype], (o, rel_err(got[o], ref[o]))


def _sized(shape, env):
    from kiln.ir.symbolic import evaluate

    return tuple(evaluate(d, env) for d in shape)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 2), (torch.bfloat16, 1)])
def test_forced_k_splits_of_paired_products(dtype, rows):
    """A paired GEMV (SwiGLU's gate absorbed into up's region, the RMSNorm folded in;
    gpt-fast's chunked w13 read at two column offsets) splits K too: each part holds
    every block's accumulator, and the last program combines them all."""
    from tests.codegen.test_matmul import FusedGateUp

    for model, dim in ((MLP(dim=128, ffn=48), 128), (FusedGateUp(d=128, f=40), 128)):
        model = model.to(dtype)
        plan = kiln.compile(model, (torch.randn(rows, 1, dim, dtype=dtype),),
                            target="interpret", compile_to="dispatch")
        (region,) = [r for r in plan.regions if r.kind == RegionKind.MATMUL
                     and any(o.target == "aten.mul.Tensor" for o in r.ops)]
        spec = grouped.generate(region, plan, get_target("interpret"))
        assert len(spec.meta["siblings"]) + len(spec.meta["column_shifts"]) == 2
        assert any(c["SPLIT_K"] > 1 for c in spec.configs)
        config = Config.make(2, 1, BLOCK_N=16, BLOCK_K=32, SPLIT_K=4)
        kernel = TritonKernel(region, spec, config, interpret=True)
        assert spec.grid_for(kernel.sizes({}), config)[2] == 4  # K = 128: a block a part
        inputs = {v: torch.randn(tuple(plan.values[v].shape), dtype=plan.values[v].dtype)
                  for v in region.inputs}
        (out,) = region.outputs
        shape, dt = tuple(plan.values[out].shape), plan.values[out].dtype
        ref, got = torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt)
        TorchKernel(region, "cpu").run(inputs, {out: ref}, {})
        kernel.run(inputs, {out: got}, {})
        assert rel_err(got, ref) <= TOL[dtype], (type(model).__name__, rel_err(got, ref))


def test_sm90_grouped_gemv_streams_weights_as_the_plain_one_does():
    """Compiled for sm_90 at Llama-3-8B's widths (no GPU): the pointer chosen before the
    K loop keeps the weight's 16-byte loads, and nothing spills."""
    sm90 = get_target("cuda:sm_90")
    model = Attention(dim=4096, heads=32, kv_heads=8).half()
    plan = kiln.compile(model, (torch.randn(1, 1, 4096).half(),), target=sm90,
                        compile_to="dispatch")
    (region,) = [r for r in plan.regions if len(products(r)) > 1]
    spec = grouped.generate(region, plan, sm90)
    loop = spec.source.split("for k0")[1].split("rm2 =")[0]
    assert "tl.where" not in loop.split("part =")[0] and "if " not in loop.split("t1 =")[0]
    config = Config.make(4, 1, BLOCK_N=64, BLOCK_K=128, SPLIT_K=16)
    binary = compile_binary(spec, config, sm90)
    sass = disassemble(binary)
    if sass is None:
        pytest.skip("Triton ships no cuobjdump here")
    assert not re.search(r"\b(LDL|STL)\b", sass) and binary.resources.spills in (0, None)
    assert sass.count("LDG.E.128") >= 8


@pytest.mark.parametrize("apart_ms,kept", [(5.0, True), (1.0, False)])
def test_timed_group_kept_only_when_faster_than_its_siblings_apart(monkeypatch, apart_ms,
                                                                   kept):
    """select_kernels weighs the grouped kernel's time (3 ms, planted) against the sum of
    the siblings' own choices; the plan is restored when the group wins."""
    from kiln.codegen import select_kernels as sk
    from kiln.codegen.kernel_plan import KernelPlan
    from kiln.ir.verify import verify_plan

    plan = kiln.compile(Attention(), (torch.randn(1, 1, 64),), target="interpret",
                        compile_to="dispatch")
    (region,) = [r for r in plan.regions if len(products(r)) > 1]
    before, n = [r.name for r in plan.regions], len(products(region))

    class Tuner:
        times = {region.name: 3.0}

    def planted(r, spec, target, ctx, plan, tuner):
        tuner.times[r.name] = apart_ms / n
        return TorchKernel(r, "cpu")

    monkeypatch.setattr(sk, "choose", planted)
    ctx = type("Ctx", (), {"target": get_target("interpret"), "options": {}})()
    kp = KernelPlan(plan, ctx.target)
    kp.kernels[region.name] = "grouped"
    sk._siblings_apart_if_faster(plan, region, ctx, kp, Tuner())
    assert verify_plan(plan) == []
    if kept:
        assert [r.name for r in plan.regions] == before and kp.kernels == {region.name:
                                                                          "grouped"}
        assert len(products(region)) == 3 and "siblings kept grouped" in region.notes[-1]
    else:
        assert len(plan.regions) == len(before) + 2
        assert set(kp.kernels) == {r.name for r in plan.regions
                                   if r.kind == RegionKind.MATMUL and r.name not in before
                                   or r is region}
        assert len(products(region)) == 1


def test_the_siblings_apart_are_built_with_the_plan(monkeypatch):
    """When candidates are timed, select_kernels hands the tuner's one pool run the specs
    each grouped kernel's siblings run as apart (timed after the group): each is the spec
    the later split makes (its build is found by source), and the plan is left as it was."""
    from copy import deepcopy

    from kiln.codegen import select_kernels as sk
    from kiln.dispatch.split import split_siblings

    target = get_target("interpret")
    plan = kiln.compile(Attention(), (torch.randn(1, 1, 64),), target=target,
                        compile_to="dispatch")
    (region,) = [r for r in plan.regions if len(products(r)) > 1]
    spec = sk.spec_for(region, plan, target)
    regions, values, ops = [r.name for r in plan.regions], dict(plan.values), deepcopy(region.ops)
    ahead = sk._apart_specs(plan, [(region, spec)], target)
    assert [r.name for r in plan.regions] == regions and plan.values == values
    assert region.ops == ops and len(products(region)) == 3
    assert len(ahead) == 3
    parts = split_siblings(plan, region, "the split select_kernels makes")
    assert [sk.spec_for(r, plan, target).source_hash for r in parts] == [
        s.source_hash for _, s in ahead]

    work = []
    monkeypatch.setattr(sk, "will_time", lambda target, ctx: True)
    monkeypatch.setattr(sk, "precompile", lambda w, *a: work.extend(w))
    exe = kiln.compile(Attention(), (torch.randn(1, 1, 64),), target=target)
    built = {r.name for r, _ in work}
    assert built - {r.name for r in exe.plan.regions} == {r.name for r in parts} - {region.name}
