"""The grouped MoE kernel (kiln.codegen.templates.moe).

Under the `interpret` target on tiny widths (tails in dim and I, several tiles per
expert, several column blocks): against a per-token loop in float64 and the op's
PyTorch form, fp32 and bf16; experts with no token, every pair on one expert, one
token, a dynamic token count (counters back to zero after every launch, the same
output twice), ids out of range (dropped, as the op's form does; no hang), x read
through a strided sub-view in place. Compile-only for sm_90 at DeepSeek-V3's widths:
the default and one candidate of each shape class compile within the resource
model's estimate (every candidate with KILN_RUN_SLOW=1), decode and prefill.
"""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.resources import estimate, fitting_configs
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel, scratch_buffer
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.moe import template as moe
from kiln.ir.plan import RegionKind
from kiln.ops import moe_experts
from kiln.target import get_target
from tests.helpers import rel_err
from tests.ops.test_moe_experts import loop_reference, make

SM90 = get_target("cuda:sm_90")


class Experts(torch.nn.Module):
    def __init__(self, gate, up, down):
        super().__init__()
        self.gate, self.up, self.down = (torch.nn.Parameter(t) for t in (gate, up, down))

    def forward(self, x, weights, ids):
        return moe_experts(x, weights, ids, self.gate, self.up, self.down)


class SlicedExperts(Experts):
    """x is columns 8..8 + dim of a wider hidden state: a strided sub-view."""

    def forward(self, hidden, weights, ids):
        dim = self.gate.shape[-1]
        return moe_experts(hidden[:, 8:8 + dim], weights, ids, self.gate, self.up, self.down)


def _region(plan):
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    return region


def _compiled(model, args, tokens=None):
    shapes = None
    if tokens is not None:
        T = kiln.Dim("T", min=1, max=tokens)
        shapes = ({0: T}, {0: T}, {0: T})
    exe = kiln.compile(model, args, dynamic_shapes=shapes, target="interpret")
    kernel = exe.program.kplan.kernels[_region(exe.program.plan).name]
    assert isinstance(kernel, TritonKernel), _region(exe.program.plan).notes
    return exe, kernel


def _counters_zero(kernel) -> bool:
    return not scratch_buffer(kernel.spec.scratch[0], 0, 1, "cpu").any()


@pytest.mark.parametrize("N,dim,E,inter,k,dtype", [
    (7, 48, 6, 40, 3, torch.float32),  # dim and I not multiples of the tiles
    (21, 64, 8, 32, 2, torch.bfloat16),
    (1, 32, 4, 16, 2, torch.float32),  # one token
    (20, 16, 16, 24, 4, torch.float32),  # 16 experts for 80 pairs: several get none
])
def test_interpreted_kernel_matches_the_loop_and_the_op(N, dim, E, inter, k, dtype):
    x, w, ids, gate, up, down = make(N, dim, E, inter, k, seed=N, dtype=dtype)
    m = Experts(gate, up, down)
    exe, kernel = _compiled(m, (x, w, ids))
    y = exe(x, w, ids)
    assert y.shape == (N, dim) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(y, loop_reference(x, w, ids, gate, up, down)) <= tol
    assert rel_err(y, m(x, w, ids)) <= tol
    assert _counters_zero(kernel)


def test_every_pair_on_one_expert_and_idle_experts():
    """18 tokens, k = 2: all 36 pairs on expert 3 (three 16-row tiles of one expert),
    then only experts 1 and 6 of 8."""
    x, w, _, gate, up, down = make(18, 48, 8, 40, 2, seed=5)
    m = Experts(gate, up, down)
    for ids in (torch.full((18, 2), 3), torch.tensor([[1, 6], [6, 1]] * 9)):
        exe, kernel = _compiled(m, (x, w, ids))
        assert rel_err(exe(x, w, ids), loop_reference(x, w, ids, gate, up, down)) <= 1e-5
        assert _counters_zero(kernel)


def test_dynamic_tokens_the_same_twice_and_counters_back_to_zero():
    """One module for 1 to 48 tokens (two routers past 32): each call twice, equal."""
    x, w, ids, gate, up, down = make(6, 32, 5, 24, 2, seed=6)
    m = Experts(gate, up, down)
    exe, kernel = _compiled(m, (x, w, ids), tokens=48)
    for n in (1, 13, 45):
        x, w, ids, *_ = make(n, 32, 5, 24, 2, seed=n)
        first, second = exe(x, w, ids), exe(x, w, ids)
        assert torch.equal(first, second), n
        assert rel_err(first, loop_reference(x, w, ids, gate, up, down)) <= 1e-5, n
        assert _counters_zero(kernel), n


def test_a_saved_module_loads_and_runs_the_kernel(tmp_path):
    x, w, ids, gate, up, down = make(9, 32, 5, 16, 2, seed=10)
    m = Experts(gate, up, down)
    exe, _ = _compiled(m, (x, w, ids), tokens=40)
    exe.save(tmp_path / "moe")
    loaded = kiln.load(tmp_path / "moe", target="interpret")
    x, w, ids, *_ = make(13, 32, 5, 16, 2, seed=11)
    assert rel_err(loaded(x, w, ids), loop_reference(x, w, ids, gate, up, down)) <= 1e-5


def test_ids_out_of_range_are_dropped_as_the_op_does():
    """A compiled module cannot refuse ids it only sees on the device: pairs outside
    [0, E) add nothing, and a token left with none gets zeros."""
    x, w, ids, gate, up, down = make(9, 32, 5, 16, 2, seed=7)
    m = Experts(gate, up, down)
    exe, kernel = _compiled(m, (x, w, ids))
    bad = ids.clone()
    bad[0, 1], bad[4] = 5, torch.tensor([-1, 70])
    y = exe(x, w, bad)
    assert rel_err(y, torch.ops.kiln.moe_experts(x, w, bad, gate, up, down)) <= 1e-5
    assert not y[4].any() and y[0].any()
    assert _counters_zero(kernel)


def test_the_gemv_form_is_for_fp8_experts_alone():
    """bf16 experts at decode keep tl.dot (their products are mma on the weights as
    stored); asking for the fp8 decode form says why not."""
    x, w, ids, *experts = make(2, 64, 3, 32, 2)
    plan = kiln.compile(Experts(*experts), (x, w, ids), compile_to="dispatch")
    assert moe.generate(_region(plan), plan, SM90).meta["form"] == "dot"
    with pytest.raises(CodegenUnsupported, match="GEMV form needs fp8 experts"):
        moe.generate(_region(plan), plan, SM90, form="gemv")


def test_x_is_read_through_a_strided_sub_view_in_place():
    x, w, ids, gate, up, down = make(11, 24, 4, 16, 2, seed=8)
    hidden = torch.randn(11, 40)
    hidden[:, 8:32] = x
    m = SlicedExperts(gate, up, down)
    exe, kernel = _compiled(m, (hidden, w, ids))
    region = _region(exe.program.plan)
    assert any(op.target == "aten.slice.Tensor" for op in region.ops)  # fused, not copied
    assert rel_err(exe(hidden, w, ids), loop_reference(x, w, ids, gate, up, down)) <= 1e-5


@pytest.mark.parametrize("params", [dict(BM=32, BN=64, BD=128, BK=64),
                                    dict(BM=64, BN=64, BD=128, BK=32)])
def test_gpu_tile_shapes_on_the_interpreter(params):
    """The GPU's tile shapes (BD = 2 BN, rows past an expert's count in a tile, one
    column block past dim and I): 30 tokens over 3 experts."""
    x, w, ids, gate, up, down = make(30, 80, 3, 72, 2, seed=9)
    m = Experts(gate, up, down)
    plan = kiln.compile(m, (x, w, ids), compile_to="dispatch")
    region = _region(plan)
    spec = moe.generate(region, plan, get_target("interpret"))
    kernel = TritonKernel(region, spec, Config.make(4, 1, **params), interpret=True)
    named = {"x": x, "weights": w, "ids": ids, "p_gate": gate, "p_up": up, "p_down": down}
    assert set(region.inputs) == set(named)
    out = {region.outputs[0]: torch.full((30, 80), float("nan"))}
    kernel.run(named, out, {})
    assert rel_err(out[region.outputs[0]], loop_reference(x, w, ids, gate, up, down)) <= 1e-5
    assert _counters_zero(kernel)


def _v3_spec(tokens: int, most: int, dtype=torch.bfloat16):
    """The kernel at DeepSeek-V3's widths (dim 7168, I 2048, 256 experts, top 8), for
    `tokens` example tokens, dynamic up to `most` (the weights on the meta device)."""
    E, inter, dim, k = 256, 2048, 7168, 8
    meta = {"device": "meta", "dtype": dtype}
    m = Experts(torch.empty(E, inter, dim, **meta), torch.empty(E, inter, dim, **meta),
                torch.empty(E, dim, inter, **meta))
    args = (torch.empty(tokens, dim, **meta), torch.empty(tokens, k, device="meta"),
            torch.empty(tokens, k, dtype=torch.long, device="meta"))
    shapes = None
    if most > tokens:
        T = kiln.Dim("T", min=1, max=most)
        shapes = ({0: T}, {0: T}, {0: T})
    plan = kiln.compile(m, args, dynamic_shapes=shapes, compile_to="dispatch")
    return moe.generate(_region(plan), plan, SM90)


def _within_estimate(spec, configs):
    for config in configs:
        real = compile_binary(spec, config, SM90).resources
        est = estimate(spec, config, SM90)
        assert real.shared <= est.shared <= SM90.shared_mem_per_block, (config, real, est)


def _one_of_each(spec) -> list[Config]:
    """The default and, per (BM, BN), the candidate with the most shared memory."""
    best = {}
    for c in spec.configs:
        key = (c["BM"], c["BN"])
        if key not in best or estimate(spec, c, SM90).shared > estimate(spec, best[key],
                                                                         SM90).shared:
            best[key] = c
    return list(dict.fromkeys([spec.default, *best.values()]))


def test_prefill_and_decode_candidates_fit_sm90_within_their_estimate():
    prefill = _v3_spec(16, 4096)
    assert {c["BM"] for c in prefill.configs} == {16, 32, 64, 128}
    assert prefill.default == moe.Config.make(8, 3, BM=64, BN=128, BD=256, BK=64)
    assert prefill.index_bits == 64  # a [256, 2048, 7168] weight passes int32
    fit = fitting_configs(prefill, SM90)
    over = moe.Config.make(8, 3, BM=64, BN=128, BD=256, BK=128)  # 240 KiB: 3 stages of 80
    assert set(prefill.configs) - set(fit.configs) == {over}
    decode = _v3_spec(2, 8)  # decode at batch 1 to 8: up to 64 pairs
    assert decode.default == moe.Config.make(4, 3, BM=16, BN=64, BD=128, BK=128)
    assert {c["BM"] for c in decode.configs} == {16, 32, 64}
    _within_estimate(prefill, [prefill.default, max(fit.configs, key=lambda c: estimate(
        prefill, c, SM90).shared)])
    _within_estimate(decode, [decode.default])


@pytest.mark.slow
def test_every_v3_candidate_fits_sm90_within_its_estimate():
    for spec in (_v3_spec(16, 4096), _v3_spec(2, 8)):
        _within_estimate(spec, fitting_configs(spec, SM90).configs)
        for config in spec.configs:  # the model's exact: those it drops do not fit
            real = compile_binary(spec, config, SM90).resources
            assert real.shared == estimate(spec, config, SM90).shared, config


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_v3_widths_on_cuda_match_the_op(tokens):
    """V3's expert widths (dim 7168, I 2048, top 8) over 32 experts in bf16 on a GPU (run
    by the lead), routing skewed (every token chooses expert 0): against the
    op's PyTorch form; the same output twice (no float atomics), counters zero after."""
    x, w, ids, gate, up, down = (t.cuda() for t in make(tokens, 7168, 32, 2048, 8,
                                                       seed=tokens, dtype=torch.bfloat16))
    ids[:, 0] = torch.where(ids.eq(0).any(1), ids[:, 0], 0)  # still distinct per token
    m = Experts(gate, up, down)
    exe = kiln.compile(m, (x, w, ids), target="cuda")
    region = _region(exe.program.plan)
    kernel = exe.program.kplan.kernels[region.name]
    assert isinstance(kernel, TritonKernel), region.notes
    first, second = exe(x, w, ids), exe(x, w, ids)
    assert torch.equal(first, second)
    ref = torch.ops.kiln.moe_experts(x, w, ids, gate, up, down)
    assert rel_err(first.cpu(), ref.cpu()) <= 1e-2, rel_err(first.cpu(), ref.cpu())
    assert not scratch_buffer(kernel.spec.scratch[0], 0, 1, x.device).any()
