"""The gated delta rule's generated kernel (kiln.codegen.templates.gated_delta).

Under the `interpret` target on tiny shapes: odd T over several chunks with a masked
tail, a decode step, initial and final state, packed sequences (one of them a single
step), value heads = 2 x key heads, bf16 inputs; against a step-by-step recurrence and
the op's PyTorch form; both forms (one-pass and staged) at forced configs. Compile-only
for sm_90 at the seed's shape (K = V = 256, 36 heads): every candidate fits shared
memory, the staged default spills little and keeps every walker on the chip at once
(at Qwen3-Next's shape its choice of value block does too), and with a crash planted
into num_warps 8
(as Triton's compiler once crashed on flash-linear-attention's kernel there) the
crashing candidate is quarantined and the rest tuned.
"""

import dataclasses

import pytest
import torch

import kiln
from kiln.codegen.autotune import verify
from kiln.codegen.autotune.quarantine import FailureKey, Quarantine
from kiln.codegen.autotune.timing import buffer_specs, make_buffers
from kiln.codegen.autotune.tuner import choose
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.resources import estimate, fitting_configs
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.gated_delta import template as gated_delta
from kiln.codegen.torch_kernel import TorchKernel
from kiln.errors import ArgumentError, IndexOutOfRangeError
from kiln.ir.plan import RegionKind
from kiln.ops import gated_delta_rule
from kiln.pipeline import Context
from kiln.target import get_target
from tests.helpers import rel_err
from tests.ops.test_gated_delta_rule import inputs, reference

SM90 = get_target("cuda:sm_90")


class Delta(torch.nn.Module):
    """The op alone, state in and final state out."""

    def forward(self, q, k, v, g, beta, state):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)


class Packed(torch.nn.Module):
    def forward(self, q, k, v, g, beta, state, cu):
        return gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                cu_seqlens=cu)


def _kernel(exe):
    (region,) = [r for r in exe.program.plan.regions if r.kind == RegionKind.EXTERN]
    return exe.program.kplan.kernels[region.name]


def test_interpreted_kernel_matches_the_recurrence_for_odd_t_and_a_decode_step():
    H, HV, K, V = 1, 2, 16, 16  # value heads = 2 x key heads
    q, k, v, g, beta = inputs(1, 20, H, HV, K, V)
    state = torch.randn(1, HV, K, V)
    T = kiln.Dim("T", min=1, max=64)
    exe = kiln.compile(Delta(), (q, k, v, g, beta, state),
                       dynamic_shapes=({1: T}, {1: T}, {1: T}, {1: T}, {1: T}, None),
                       target="interpret")
    kernel = _kernel(exe)
    assert isinstance(kernel, TritonKernel) and kernel.config["STAGED"] == 1
    for t in (37, 1):  # three chunks, the last 5 steps long; one step (decode)
        q, k, v, g, beta = inputs(1, t, H, HV, K, V, seed=t)
        state = torch.randn(1, HV, K, V)
        o, final = exe(q, k, v, g, beta, state)
        ref_o, ref_s = reference(q, k, v, g, beta, K ** -0.5, state)
        assert rel_err(o, ref_o) <= 1e-5, (t, rel_err(o, ref_o))
        assert rel_err(final, ref_s) <= 1e-5, (t, rel_err(final, ref_s))


def test_interpreted_kernel_runs_packed_sequences_from_their_own_states():
    H, HV, K, V = 1, 2, 16, 16
    cu = [0, 1, 19, 24]  # a one-step sequence takes the decode branch
    q, k, v, g, beta = inputs(1, cu[-1], H, HV, K, V, seed=3)
    states = torch.randn(len(cu) - 1, HV, K, V)
    args = (q, k, v, g, beta, states, torch.tensor(cu, dtype=torch.int32))
    exe = kiln.compile(Packed(), args, target="interpret")
    assert isinstance(_kernel(exe), TritonKernel)
    o, final = exe(*args)
    eager_o, eager_s = Packed()(*args)
    assert rel_err(o, eager_o) <= 1e-5 and rel_err(final, eager_s) <= 1e-5
    for n, (s, e) in enumerate(zip(cu, cu[1:])):
        ref_o, ref_s = reference(*(x[:, s:e] for x in (q, k, v, g, beta)), K ** -0.5,
                                 states[n:n + 1])
        assert rel_err(o[:, s:e], ref_o) <= 1e-5, n
        assert rel_err(final[n:n + 1], ref_s) <= 1e-5, n


def test_bad_sequence_bounds_are_an_index_error_not_a_read_past_the_tokens():
    """cu_seqlens past T, below 0 or decreasing: the interpret target raises (what a GPU
    would read past the tokens); a GPU target clamps the bounds into [0, T]."""
    H, HV, K, V = 1, 1, 16, 16
    q, k, v, g, beta = inputs(1, 9, H, HV, K, V, seed=5)
    states = torch.randn(2, HV, K, V)
    good = torch.tensor([0, 4, 9], dtype=torch.int32)
    exe = kiln.compile(Packed(), (q, k, v, g, beta, states, good), target="interpret")
    o, _ = exe(q, k, v, g, beta, states, good)
    assert rel_err(o, Packed()(q, k, v, g, beta, states, good)[0]) <= 1e-5
    for bad in ([0, 4, 40], [-3, 4, 9], [0, 6, 2]):
        with pytest.raises(IndexOutOfRangeError, match="gated_delta_rule"):
            exe(q, k, v, g, beta, states, torch.tensor(bad, dtype=torch.int32))
        with pytest.raises(ArgumentError, match="cu_seqlens"):  # the torch form, as eager
            Packed()(q, k, v, g, beta, states, torch.tensor(bad, dtype=torch.int32))
    o, _ = exe(q, k, v, g, beta, states, good)  # the stopped launches left no counts behind
    assert rel_err(o, Packed()(q, k, v, g, beta, states, good)[0]) <= 1e-5


def test_the_gpu_kernel_clamps_sequence_bounds_into_the_tokens():
    args = (*inputs(1, 9, 1, 1, 16, 16), torch.randn(2, 1, 16, 16),
            torch.tensor([0, 4, 9], dtype=torch.int32))
    plan = kiln.compile(Packed(), args, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    spec = gated_delta.generate(region, plan, SM90)
    assert "bos = tl.minimum(tl.maximum(bos, 0)" in spec.source
    assert "eos = tl.minimum(tl.maximum(eos, bos)" in spec.source
    assert "tl.device_assert" not in spec.source  # no per-call check on a GPU


def test_interpreted_bf16_kernel_and_a_static_decode_step():
    H, HV, K, V = 2, 2, 16, 32
    q, k, v, g, beta = inputs(1, 41, H, HV, K, V, seed=5)
    state = torch.randn(1, HV, K, V)
    half = (q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    exe = kiln.compile(Delta(), half, target="interpret")
    assert _kernel(exe).config["STAGED"] == 1  # its states and values stored in bf16
    o, final = exe(*half)
    ref_o, ref_s = reference(q, k, v, g, beta, K ** -0.5, state)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert rel_err(o, ref_o) <= 1e-2 and rel_err(final, ref_s) <= 1e-2

    one = tuple(x[:, :1] for x in (q, k, v, g, beta)) + (state,)  # T = 1: decode only
    exe = kiln.compile(Delta(), one, target="interpret")
    assert "for c0 in range" not in _kernel(exe).spec.source
    o, final = exe(*one)
    ref_o, ref_s = reference(*one[:5], K ** -0.5, state)
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(final, ref_s) <= 1e-5


@pytest.mark.parametrize("staged,chunk", [(0, 16), (1, 32)])
def test_both_forms_match_the_recurrence_over_value_blocks(staged, chunk):
    """Either form at a forced config: two batch rows, odd T, two BV blocks (two walkers
    and flags per head), value heads = 2 x key heads, initial and final state; launched
    twice, so the counters and flags are zero again after a launch."""
    H, HV, K, V = 1, 2, 16, 32
    q, k, v, g, beta = inputs(2, 45, H, HV, K, V, seed=9)
    state = torch.randn(2, HV, K, V)
    args = (q, k, v, g, beta, state)
    plan = kiln.compile(Delta(), args, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    spec = gated_delta.generate(region, plan, get_target("interpret"))
    config = Config.make(4, 1, CHUNK=chunk, BV=16, STAGED=staged)
    assert config in spec.configs
    kernel = TritonKernel(region, spec, config, interpret=True)
    named = dict(zip(region.inputs, args))
    ref_o, ref_s = reference(q, k, v, g, beta, K ** -0.5, state)
    for _ in range(2):
        outs = {o: torch.full(tuple(plan.values[o].shape), float("nan"),
                              dtype=plan.values[o].dtype) for o in region.outputs}
        kernel.run(named, outs, {})
        o, final = sorted(outs.values(), key=lambda t: t.shape != ref_o.shape)
        assert rel_err(o, ref_o) <= 1e-5 and rel_err(final, ref_s) <= 1e-5


def test_the_cpu_target_and_other_extern_ops_still_run_as_torch_ops():
    args = inputs(1, 5, 1, 1, 8, 8) + (torch.zeros(1, 1, 8, 8),)
    exe = kiln.compile(Delta(), args, target="cpu")
    assert isinstance(_kernel(exe), TorchKernel)

    class Sort(torch.nn.Module):
        def forward(self, x):
            return x.sort(-1).values

    exe = kiln.compile(Sort(), (torch.randn(4, 8),), target="interpret")
    (region,) = [r for r in exe.program.plan.regions if r.kind == RegionKind.EXTERN]
    assert isinstance(exe.program.kplan.kernels[region.name], TorchKernel)
    assert any("kiln generates no kernel" in n for n in region.notes)


def _seed_spec(dtype=torch.bfloat16, H=36, HV=36, K=256):
    """The kernel at the seed's shape: q, k, v [1, T, 36, 256], fp32 g, dynamic T."""
    T = 128
    q, k = (torch.randn(1, T, H, K, dtype=dtype) for _ in range(2))
    v = torch.randn(1, T, HV, K, dtype=dtype)
    g, beta = -torch.rand(1, T, HV), torch.rand(1, T, HV, dtype=dtype)

    class Op(torch.nn.Module):
        def forward(self, q, k, v, g, beta):
            return gated_delta_rule(q, k, v, g, beta)[0]

    dim = kiln.Dim("T", min=1, max=8192)
    plan = kiln.compile(Op(), (q, k, v, g, beta), compile_to="dispatch",
                        dynamic_shapes=({1: dim},) * 5)
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    return region, plan, gated_delta.generate(region, plan, SM90)


def _programs_per_sm(registers: int, warps: int) -> int:
    return SM90.registers_per_block // (-(-registers // 8) * 8 * warps * 32)


def test_every_seed_shape_candidate_fits_sm90_and_the_staged_default_holds_its_walkers():
    """Every candidate is estimated to fit shared memory; the default (staged, 64-step
    chunks, 64 columns: the largest estimate) compiles for sm_90 within it, spills at
    most a few words, and two of its programs share an SM, so all 144 walkers (36 heads
    x 4 column blocks) run at once with slots left for the output programs. (The
    walker's four key blocks loaded together spill 14-40 words, and its chunk ran
    faster so: 9.5 -> 8.3 us on an H200.)"""
    _, _, spec = _seed_spec()
    warps = {c.num_warps for c in spec.configs}
    assert {8, 16} <= warps
    fit = fitting_configs(spec, SM90)
    assert set(fit.configs) == set(spec.configs)  # estimated to fit, none dropped
    c = spec.default
    assert c["STAGED"] == 1 and (c["CHUNK"], c["BV"], c.num_warps) == (64, 64, 4)
    largest = max(estimate(spec, x, SM90).shared for x in spec.configs)
    assert estimate(spec, c, SM90).shared == largest
    res = compile_binary(spec, c, SM90).resources
    assert res.shared <= largest <= SM90.shared_mem_per_block
    assert res.spills <= 64, res.spills
    walkers = 36 * 256 // c["BV"]
    assert walkers < _programs_per_sm(res.registers, c.num_warps) * SM90.multiprocessors


@pytest.mark.parametrize("dtype,warps,chunk", [(torch.bfloat16, 4, 64), (torch.float32, 8, 32)])
def test_the_staged_default_fits_every_walker_at_qwen3_next_shape(dtype, warps, chunk):
    """16 key heads, 32 value heads of 128: the narrowest value block whose 128 walkers
    all fit at once (two programs an SM on 4 warps; one on 8 for fp32's FMA dots)."""
    _, _, spec = _seed_spec(dtype, H=16, HV=32, K=128)
    c = spec.default
    assert c["STAGED"] == 1 and (c["CHUNK"], c["BV"], c.num_warps) == (chunk, 32, warps)


def test_a_crashing_candidate_is_quarantined_and_the_rest_tuned():
    region, plan, spec = _seed_spec()
    # the seed's story: the first choice is an 8-warp config, and 8 warps abort Triton
    eight = Config.make(8, spec.default.num_stages, **dict(spec.default.params))
    assert eight in spec.configs
    spec = dataclasses.replace(spec, default=eight)
    ctx = Context(SM90, {"tune_compiler": "tests.codegen.crashy:compile_abort_on_8_warps",
                         "tune": "fast"})
    kernel = choose(region, spec, SM90, ctx, plan)
    assert isinstance(kernel, TritonKernel) and kernel.config.num_warps != 8
    assert kernel.binary.resources.shared <= SM90.shared_mem_per_block
    crash = Quarantine().get(FailureKey.of(spec, eight, SM90))
    assert crash is not None and crash.kind == "crash" and "SIGABRT" in crash.reason
    assert "tuned" in region.notes[-1] and "crash" in region.notes[-1]


@pytest.mark.parametrize("dtype,chunks", [(torch.float16, {16, 32, 64}),
                                          (torch.float32, {16, 32})])
def test_configs_cover_both_forms_chunks_value_blocks_and_warps(dtype, chunks):
    """fp32 dots run on FMA units: 64-step chunks are left out (slow to compile, spill).
    The staged form stores a state per chunk: no 16-step chunks."""
    _, _, spec = _seed_spec(dtype)
    for form, want in ((0, chunks), (1, chunks - {16})):
        configs = [c for c in spec.configs if c["STAGED"] == form]
        assert {c["CHUNK"] for c in configs} == want
        assert {c["BV"] for c in configs} == {16, 32, 64}
        assert {c.num_warps for c in configs} == {4, 8, 16}
    assert spec.default["STAGED"] == 1 and spec.default.num_warps == (
        8 if dtype == torch.float32 else 4)


def test_staged_16_bit_candidates_on_many_warps_keep_wide_value_blocks():
    """bf16 at K = V = 128, BV 32 on 8 warps faulted on an H200 (template._faults_staged):
    no 16-bit staged candidate pairs 8+ warps with BV <= 32; fp32 (FMA dots) keeps them,
    and every other warp count and value block is still a candidate."""
    _, _, spec = _seed_spec(torch.bfloat16, H=16, HV=32, K=128)
    staged = [c for c in spec.configs if c["STAGED"] == 1]
    assert staged and not [c for c in staged if c.num_warps >= 8 and c["BV"] <= 32]
    assert {c["BV"] for c in staged} == {128, 64, 32}
    assert {c.num_warps for c in staged} == {4, 8, 16}
    _, _, fp32 = _seed_spec(torch.float32, H=16, HV=32, K=128)
    assert [c for c in fp32.configs if c["STAGED"] == 1 and c.num_warps == 8 and c["BV"] == 32]


@pytest.mark.parametrize("packed", [False, True])
def test_the_tuners_inputs_are_as_models_give_them_and_a_right_kernel_matches(packed):
    """The tuner times and checks candidates on inputs from the template's timing fill:
    unit-norm q and k, log decays <= 0, betas in (0, 1), packed sequences of even
    lengths (zeros would make every sequence empty). On them the kernel (interpret
    target) matches the region's torch form within the tuner's tolerance, so its output
    check can tell a wrong candidate from a right one."""
    H, HV, K, V, T = 1, 2, 16, 16, 70
    q, k, v, g, beta = inputs(1, T, H, HV, K, V, seed=4)
    q, k, v, beta = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    state = torch.zeros(3 if packed else 1, HV, K, V)
    args = (q, k, v, g, beta, state) + ((torch.tensor([0, 20, 21, T]),) if packed else ())
    plan = kiln.compile(Packed() if packed else Delta(), args, compile_to="dispatch")
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    spec = gated_delta.generate(region, plan, get_target("interpret"))
    fill = spec.meta["timing_fill"]
    assert sorted(next(iter(f)) for f in fill.values()) == sorted(
        ["unit_rows", "unit_rows", "log_decay", "unit_interval"]
        + (["sequence_bounds"] if packed else []))
    bufs, outs = make_buffers(buffer_specs(region, plan, {}, fill), "cpu", seed=1)
    named = dict(zip(region.inputs, bufs.values()))
    by_arg = {a.name: named.get(a.name) for a in region.anchor().args[:5]}
    qb, kb, _, gb, bb = by_arg.values()
    assert torch.allclose(kb.float().norm(dim=-1), torch.ones(1), atol=1e-2)
    assert torch.allclose(qb.float().norm(dim=-1), torch.ones(1), atol=1e-2)
    assert bool((gb <= 0).all()) and bool(((bb > 0) & (bb < 1)).all())
    if packed:
        cu = named[region.anchor().args[7].name]
        assert cu.tolist() == [0, 23, 46, T]
    want = verify.outputs(TorchKernel(region, "cpu"), named, outs, {})
    kernel = TritonKernel(region, spec, spec.default, interpret=True)
    got = verify.outputs(kernel, named, outs, {})
    assert all(bool(torch.isfinite(w).all()) for w in want.values())
    assert verify.mismatch(got, want) is None
