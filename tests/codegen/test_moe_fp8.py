"""The grouped MoE kernel's fp8 form (kiln.codegen.templates.moe.fp8, kiln::moe_experts_fp8).

Under the `interpret` target on small widths (dim and I with tail blocks past 128 and
past the tiles, several experts, an id out of range): against the op's PyTorch form
(which defines it: every product kiln::fp8_linear's), fp32 and bf16, and the counters
back to zero. Compile-only for sm_90 at DeepSeek-V3's widths: the decode default
compiles without spills within the resource model's estimate (every candidate, exact,
with KILN_RUN_SLOW=1); GPUs without e4m3 decline with the reason. On a GPU (run by
the lead): V3's widths against the op's PyTorch form.
"""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.resources import estimate, fitting_configs
from kiln.codegen.build.triton_kernel import TritonKernel, scratch_buffer
from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.moe import template as moe
from kiln.ir.plan import RegionKind
from kiln.target import get_target
from tests.helpers import rel_err
from tests.ops.test_moe_experts_fp8 import Fp8Experts, loop_reference, make_fp8

SM90 = get_target("cuda:sm_90")


def _region(plan):
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    return region


def _interpreted(m, args):
    exe = kiln.compile(m, args, target="interpret")
    kernel = exe.program.kplan.kernels[_region(exe.program.plan).name]
    assert isinstance(kernel, TritonKernel), _region(exe.program.plan).notes
    assert kernel.spec.template == "moe_fp8"
    return exe, kernel


@pytest.mark.parametrize("N,form", [(4, "gemv"), (9, "dot")])
def test_interpreted_fp32_with_tails_and_an_id_out_of_range(N, form):
    """dim 200 and I 136: a tail K block in both products, tiles past both widths; a
    pair naming expert 3 of 3 adds nothing, as the op drops it. Both forms: the
    GEMV up to 8 tokens, tl.dot above."""
    args, real = make_fp8(N, 200, 3, 136, 2, seed=1)
    m = Fp8Experts(*args[3:])
    exe, kernel = _interpreted(m, args[:3])
    assert kernel.spec.meta["form"] == form
    bad = args[2].clone()
    bad[1, 0] = 3
    y = exe(args[0], args[1], bad)
    assert rel_err(y, torch.ops.kiln.moe_experts_fp8(args[0], args[1], bad, *args[3:])) <= 1e-5
    assert not y[1].equal(torch.zeros_like(y[1])) and not scratch_buffer(
        kernel.spec.scratch[0], 0, 1, "cpu").any()
    keep = torch.tensor([0, 2, 3])  # the tokens whose pairs are all valid
    ref = loop_reference((args[0][keep], args[1][keep], args[2][keep]), real)
    assert rel_err(y[keep], ref) <= 1e-5


def test_interpreted_bf16_rounds_where_the_op_does():
    """bf16: g, u, silu(g), h and each pair's output rounded where the op's products
    round, so the re-quantised h is the op's (measured: equal on the interpreter)."""
    args, real = make_fp8(5, 256, 3, 128, 2, seed=2, dtype=torch.bfloat16)
    m = Fp8Experts(*args[3:])
    exe, _ = _interpreted(m, args[:3])
    y = exe(*args[:3])
    assert y.dtype == torch.bfloat16
    assert rel_err(y, m(*args[:3])) <= 1e-3
    assert rel_err(y, loop_reference(args, real)) <= 2e-2


def test_a_gpu_tile_spanning_two_scale_blocks_on_the_interpreter():
    """BD = 256 down columns over dim 200: one tile reads two 128-row blocks' scales
    (each column its own)."""
    args, _ = make_fp8(3, 200, 3, 136, 2, seed=3)
    m = Fp8Experts(*args[3:])
    plan = kiln.compile(m, args[:3], compile_to="dispatch")
    region = _region(plan)
    spec = moe.generate(region, plan, get_target("interpret"), form="dot")
    kernel = TritonKernel(region, spec, moe.Config.make(4, 1, BM=16, BN=64, BD=256, BK=128),
                          interpret=True)
    weights = {f"p_w_{i}": t for i, t in enumerate(args[3:])}  # the ParameterList's
    named = {"x": args[0], "weights": args[1], "ids": args[2], **weights}
    assert set(region.inputs) == set(named)
    out = {region.outputs[0]: torch.full((3, 200), float("nan"))}
    kernel.run(named, out, {})
    assert rel_err(out[region.outputs[0]], m(*args[:3])) <= 1e-5


@pytest.mark.parametrize("config", [None, moe.Config.make(4, 1, BM=4, BN=16, BD=32, KB=2)])
def test_interpreted_gemv_with_skewed_routing_and_dynamic_tokens(config):
    """Up to 8 dynamic tokens (the GEMV form): expert 0 chosen by every token (tiles
    of 2 or 4 rows, the last part full), expert 1 by none, the rest spread; each
    token count against the op. The default's 2-row tiles and 4-row tiles."""
    args, _ = make_fp8(8, 256, 4, 128, 2, seed=6)
    m = Fp8Experts(*args[3:])
    T = kiln.Dim("T", min=1, max=8)
    shapes = ({0: T}, {0: T}, {0: T})
    plan = kiln.compile(m, args[:3], dynamic_shapes=shapes, compile_to="dispatch")
    region = _region(plan)
    spec = moe.generate(region, plan, get_target("interpret"))
    assert spec.meta["form"] == "gemv" and spec.default["BM"] == 2
    kernel = TritonKernel(region, spec, config or spec.default, interpret=True)
    weights = {f"p_w_{i}": t for i, t in enumerate(args[3:])}
    ids = torch.stack([torch.zeros(8, dtype=torch.long), torch.tensor([2, 3] * 4)], 1)
    for t in (7, 1):
        x, w = args[0][:t], args[1][:t]
        named = {"x": x, "weights": w, "ids": ids[:t], **weights}
        out = {region.outputs[0]: torch.full((t, 256), float("nan"))}
        kernel.run(named, out, {str(plan.values["x"].shape[0]): t})
        want = m(x, w, ids[:t])
        assert rel_err(out[region.outputs[0]], want) <= 1e-5, t
        assert not scratch_buffer(kernel.spec.scratch[0], 0, 1, "cpu").any()


def test_interpreted_packed_gemv_with_dynamic_tokens(monkeypatch):
    """The GPUs' packed fp16 product (fp8_matmul/packed_product.py, its PTX emulated on
    the interpreter) in both K loops: dim and I whole 512-wide steps, each tile row's x
    (and h) paired with the right bytes of each expert's weight words. A few 1e-3
    off the op: fp16 sums move g and u by ~1e-4, and h's e4m3 quantisation turns that
    into more (a 1e-4 change of x moves this op's output 1.8e-2); a wrong pairing is
    ~1 off."""
    from kiln.codegen.templates.fp8_matmul import packed_product

    monkeypatch.setattr(packed_product, "packs", lambda target, k_tail: not k_tail)
    args, _ = make_fp8(4, 512, 2, 512, 2, seed=8)
    m = Fp8Experts(*args[3:])
    T = kiln.Dim("T", min=1, max=8)
    plan = kiln.compile(m, args[:3], dynamic_shapes=({0: T},) * 3, compile_to="dispatch")
    region = _region(plan)
    spec = moe.generate(region, plan, get_target("interpret"))
    assert spec.meta["form"] == "gemv" and "p_lo" in spec.source
    config = moe.Config.make(4, 1, BM=2, BN=16, BD=32, KB=4)  # two rows, four blocks
    kernel = TritonKernel(region, spec, config, interpret=True)
    weights = {f"p_w_{i}": t for i, t in enumerate(args[3:])}
    for t in (4, 1):
        named = {"x": args[0][:t], "weights": args[1][:t], "ids": args[2][:t], **weights}
        out = {region.outputs[0]: torch.full((t, 512), float("nan"))}
        kernel.run(named, out, {str(plan.values["x"].shape[0]): t})
        want = m(args[0][:t], args[1][:t], args[2][:t])
        assert rel_err(out[region.outputs[0]], want) <= 1e-2, t


def _v3_spec(tokens: int, most: int, target=SM90, form=None):
    """The kernel at DeepSeek-V3's widths (dim 7168, I 2048, 256 experts, top 8) in bf16
    for `tokens` example tokens, dynamic up to `most` (weights on the meta device)."""
    E, inter, dim, k = 256, 2048, 7168, 8
    f8 = {"device": "meta", "dtype": torch.float8_e4m3fn}
    m = Fp8Experts(torch.empty(E, inter, dim, **f8), torch.empty(E, 16, 56, device="meta"),
                   torch.empty(E, inter, dim, **f8), torch.empty(E, 16, 56, device="meta"),
                   torch.empty(E, dim, inter, **f8), torch.empty(E, 56, 16, device="meta"))
    args = (torch.empty(tokens, dim, device="meta", dtype=torch.bfloat16),
            torch.empty(tokens, k, device="meta"),
            torch.empty(tokens, k, dtype=torch.long, device="meta"))
    shapes = None
    if most > tokens:
        T = kiln.Dim("T", min=1, max=most)
        shapes = ({0: T}, {0: T}, {0: T})
    plan = kiln.compile(m, args, dynamic_shapes=shapes, compile_to="dispatch")
    return moe.generate(_region(plan), plan, target, form=form)


@pytest.mark.parametrize("tokens,most,rows", [(1, 1, 1), (2, 8, 2)])
def test_decode_takes_the_gemv_and_it_streams_16_byte_vectors_on_sm90(tokens, most, rows):
    """Decode (batch 1, and up to 8): the GEMV form by default; its default compiles
    for sm_90 within the model's shared memory, at 128 registers at most (four
    programs an SM), without spilling, reading the weights in 128-bit loads with no
    layout conversion of a weight step (x goes to its layout); every candidate fits."""
    spec = _v3_spec(tokens, most)
    assert spec.meta["form"] == "gemv" and spec.default["BM"] == rows
    assert set(fitting_configs(spec, SM90).configs) == set(spec.configs)
    binary = compile_binary(spec, spec.default, SM90)
    real = binary.resources
    assert real.shared <= estimate(spec, spec.default, SM90).shared, real
    assert real.spills == 0 and real.registers <= 128, real
    assert "ld.global.v4.b32" in binary.asm["ptx"]
    ttgir = binary.asm["ttgir"]
    assert not any(f"convert_layout %{w}" in ttgir for w in ("gw", "uw", "dw")), ttgir
    assert "tl.dot" not in spec.source


def test_decode_dot_form_compiles_for_sm90_within_its_estimate():
    decode = _v3_spec(2, 8, form="dot")
    assert decode.default == moe.Config.make(4, 3, BM=16, BN=64, BD=128, BK=128)
    assert {c["BK"] for c in decode.configs} == {128}
    real = compile_binary(decode, decode.default, SM90).resources
    assert real.spills == 0 and real.shared == estimate(decode, decode.default, SM90).shared
    prefill = _v3_spec(16, 4096)
    assert prefill.default == moe.Config.make(8, 3, BM=64, BN=128, BD=256, BK=128)
    assert prefill.index_bits == 64


@pytest.mark.slow
def test_every_v3_candidate_compiles_for_sm90_as_estimated():
    for spec in (_v3_spec(16, 4096), _v3_spec(2, 8, form="dot")):
        for config in spec.configs:
            real = compile_binary(spec, config, SM90).resources
            assert real.shared == estimate(spec, config, SM90).shared, config
            assert real.spills == 0, (config, real)
    for spec in (_v3_spec(1, 1), _v3_spec(2, 8)):  # the GEMV: upper bound
        for config in spec.configs:
            real = compile_binary(spec, config, SM90).resources
            assert real.shared <= estimate(spec, config, SM90).shared, config
            assert real.spills == 0, (config, real)


def test_gpus_without_e4m3_decline_with_the_reason():
    with pytest.raises(CodegenUnsupported, match="from sm_89"):
        _v3_spec(2, 8, get_target("cuda:sm_80"))
    assert "tl.float8e4b8" in _v3_spec(2, 8, get_target("rocm:gfx942")).source


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_v3_widths_on_cuda_match_the_op(tokens):
    """V3's expert widths (dim 7168, I 2048, top 8) over 32 fp8 experts, bf16 x, on a GPU,
    routing skewed (every token chooses expert 0): against the op's PyTorch form (bf16
    rounding moves a re-quantised h by whole e4m3 steps now and then: 2e-2, as the op's
    own bf16 test); the same output twice, counters zero after."""
    from tests.ops.test_moe_experts import make

    x, w, ids, *real = make(tokens, 7168, 32, 2048, 8, seed=tokens)
    ids[:, 0] = torch.where(ids.eq(0).any(1), ids[:, 0], 0)  # still distinct per token
    fp8 = [t for r in real for t in kiln.ops.quantize_experts(r.cuda())]
    x, w, ids = x.cuda().bfloat16(), w.cuda(), ids.cuda()
    m = Fp8Experts(*fp8)
    exe = kiln.compile(m, (x, w, ids), target="cuda")
    kernel = exe.program.kplan.kernels[_region(exe.program.plan).name]
    assert isinstance(kernel, TritonKernel), _region(exe.program.plan).notes
    first, second = exe(x, w, ids), exe(x, w, ids)
    assert torch.equal(first, second)
    ref = torch.ops.kiln.moe_experts_fp8(x, w, ids, *fp8)
    assert rel_err(first.cpu(), ref.cpu()) <= 2e-2, rel_err(first.cpu(), ref.cpu())
    assert not scratch_buffer(kernel.spec.scratch[0], 0, 1, x.device).any()
