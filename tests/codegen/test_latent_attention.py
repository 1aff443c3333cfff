"""The latent attention kernel (kiln.codegen.templates.latent_attention).

Under the `interpret` target on tiny widths (latent 32 + rope 8, 4 and 8 heads): a
batch of two rows of different lengths (not multiples of the key block or the cache
block), contiguous and paged (blocks out of order), decode and a chunk of three
queries, fp32 and bf16, the keys split across programs and not; against the einsum
form and the op's PyTorch form. Compile-only for sm_90 at DeepSeek-V3's widths (512 +
64, bf16; 128 heads, and 16 as on one rank of eight): every candidate is estimated to
fit and its compiled shared memory is within the estimate.
"""

import pytest
import torch

import kiln
from kiln.codegen.build.compiler import compile_binary
from kiln.codegen.build.resources import estimate, fitting_configs
from kiln.codegen.build.spec import Config
from kiln.codegen.build.triton_kernel import TritonKernel
from kiln.codegen.templates.latent_attention import merge
from kiln.codegen.templates.latent_attention import template as latent
from kiln.codegen.torch_kernel import TorchKernel
from kiln.ir.plan import RegionKind
from kiln.ops import latent_attention
from kiln.target import get_target
from tests.helpers import rel_err
from tests.ops.test_latent_attention import einsum_reference, inputs, paged

SM90 = get_target("cuda:sm_90")
INTERPRET = get_target("interpret")
SCALE = 0.3


class Contiguous(torch.nn.Module):
    """The op over a cache [rows, S, R + P], split into its two parts by views."""

    def __init__(self, latent_dim: int):
        super().__init__()
        self.r = latent_dim

    def forward(self, q_latent, q_rope, cache, pos):
        return latent_attention(q_latent, q_rope, cache[..., :self.r], cache[..., self.r:],
                                pos, SCALE)


class Paged(Contiguous):
    def forward(self, q_latent, q_rope, pool, pos, table):
        return latent_attention(q_latent, q_rope, pool[..., :self.r], pool[..., self.r:], pos,
                                SCALE, table)


def _region(plan):
    (region,) = [r for r in plan.regions if r.kind == RegionKind.EXTERN]
    return region


def _case(B=2, Sq=1, H=4, R=32, P=8, S=40, dtype=torch.float32, block=None, seed=0):
    """(module, args, reference): rows of lengths 14 and 39 (their last positions)."""
    q_latent, q_rope, cache = inputs(B, Sq, H, R, P, S, seed=seed, dtype=dtype)
    last = torch.tensor([13, 38])[:B]
    pos = last[:, None] - torch.arange(Sq - 1, -1, -1)[None, :]  # a chunk ending at `last`
    ref = einsum_reference(q_latent, q_rope, cache[..., :R], cache[..., R:], pos, SCALE)
    if block is None:
        return Contiguous(R), (q_latent, q_rope, cache, pos), ref
    pool, table = paged(cache, block, seed=seed)
    return Paged(R), (q_latent, q_rope, pool, pos, table), ref


@pytest.mark.parametrize("block", [None, 4], ids=["contiguous", "paged"])
@pytest.mark.parametrize("H,Sq", [(4, 1), (8, 3)])
def test_interpreted_kernel_matches_the_einsum_form(block, H, Sq):
    model, args, ref = _case(H=H, Sq=Sq, block=block, seed=H + Sq)
    exe = kiln.compile(model, args, target="interpret")
    kernel = exe.program.kplan.kernels[_region(exe.program.plan).name]
    assert isinstance(kernel, TritonKernel)
    out = exe(*args)
    assert rel_err(out, ref) <= 1e-5, rel_err(out, ref)
    assert rel_err(out, model(*args)) <= 1e-5


def test_interpreted_bf16_kernel():
    model, args, ref = _case(H=8, dtype=torch.bfloat16, block=8, seed=3)
    out = kiln.compile(model, args, target="interpret")(*args)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 1e-2


class Views(torch.nn.Module):
    """q_rope one head broadcast to all, the cache a transposed view: read in place."""

    def forward(self, q_latent, q_rope_one, cache_t, pos):
        q_rope = q_rope_one.expand(-1, -1, q_latent.shape[2], -1)
        cache = cache_t.transpose(1, 2)
        return latent_attention(q_latent, q_rope, cache[..., :30], cache[..., 30:], pos, SCALE)


def test_operands_are_read_through_their_views():
    gen = torch.Generator().manual_seed(11)
    args = (torch.randn(2, 1, 5, 30, generator=gen), torch.randn(2, 1, 1, 6, generator=gen),
            torch.randn(2, 36, 21, generator=gen), torch.tensor([[7], [20]]))
    exe = kiln.compile(Views(), args, target="interpret")
    region = _region(exe.program.plan)
    assert isinstance(exe.program.kplan.kernels[region.name], TritonKernel)
    assert set(region.inputs) == {"q_latent", "q_rope_one", "cache_t", "pos"}  # no copies
    q_latent, q_rope_one, cache_t, pos = args
    cache = cache_t.transpose(1, 2)
    ref = einsum_reference(q_latent, q_rope_one.expand(-1, -1, 5, -1), cache[..., :30],
                           cache[..., 30:], pos, SCALE)
    assert rel_err(exe(*args), ref) <= 1e-5


def _kernel_at(model, args, **params):
    """The kernel with some tunables set, run by the interpreter on `args`."""
    plan = kiln.compile(model, args, compile_to="dispatch")
    region = _region(plan)
    spec = latent.generate(region, plan, INTERPRET)
    d = spec.default
    config = Config.make(d.num_warps, d.num_stages, **{**d.as_dict(), **params})
    kernel = TritonKernel(region, spec, config, interpret=True)
    named = dict(zip(region.inputs, args))
    out = {region.outputs[0]: torch.full(tuple(args[0].shape), float("nan"))}
    return kernel, named, out


@pytest.mark.parametrize("split,R", [(1, 32), (4, 32), (4, 160), (2, 160)])
def test_keys_split_across_programs_or_not_give_the_same_output(split, R, monkeypatch):
    """128 keys, 4 parts of 16 of each row's keys: row 0 (14 keys) has one part with keys,
    row 1 (39) three (the merge's balance lifted: at these widths it allows 3 parts).
    The parts are merged by programs of their own, one per 64 output columns but never
    more than the parts: one at R = 32; at 160 (padded to 256, the last chunk partly past
    the latent) four; with 2 parts of 4 chunks (fewer than merge.SPREAD_MIN) by the last
    part to arrive, alone."""
    monkeypatch.setattr(latent, "MERGE_BALANCE", 100.0)
    model, args, ref = _case(R=R, S=128, block=4, seed=7)
    kernel, named, out = _kernel_at(model, args, BLOCK_H=16, BLOCK_N=16, KV_SPLIT=split)
    sizes = kernel.sizes({})
    chunks = 1 if R == 32 else 4
    merges = min(split, chunks) if split >= max(2, min(merge.SPREAD_MIN, chunks)) else 0
    assert kernel.spec.grid_for(sizes, kernel.config)[2] == split + merges
    for _ in range(2):  # twice: the arrival counters are zero again for the next launch
        kernel.run(named, out, {})
        (got,) = out.values()
        assert rel_err(got, ref) <= 1e-5, rel_err(got, ref)


def test_a_latent_too_wide_for_registers_runs_as_the_torch_op():
    model, args, ref = _case(B=1, H=1, R=2048, P=8, S=4)
    exe = kiln.compile(model, args, target="interpret")
    region = _region(exe.program.plan)
    assert isinstance(exe.program.kplan.kernels[region.name], TorchKernel)
    assert any("latent width 2048" in n for n in region.notes)
    assert rel_err(exe(*args), ref) <= 1e-5


def _v3_spec(heads: int, block: int | None):
    """The kernel at DeepSeek-V3's widths in bf16, decode at batch 2."""
    model, args, _ = _case(H=heads, R=512, P=64, S=256, dtype=torch.bfloat16, block=block)
    plan = kiln.compile(model, args, compile_to="dispatch")
    return latent.generate(_region(plan), plan, SM90)


@pytest.mark.parametrize("heads,block,block_h", [(128, None, 64), (128, None, 32),
                                                 (128, None, 16), (16, 64, 16)],
                         ids=["128-contiguous-64", "128-contiguous-32", "128-contiguous-16",
                              "16-paged-16"])
def test_every_v3_candidate_fits_sm90_within_its_estimate(heads, block, block_h):
    """Each head block's candidates (key blocks, split or not) compiled for sm_90."""
    spec = _v3_spec(heads, block)
    assert {c["BLOCK_H"] for c in spec.configs} == ({16, 32, 64} if heads > 16 else {16})
    assert {c["KV_SPLIT"] for c in spec.configs} == {1, latent.SPLIT_CAP}
    fit = fitting_configs(spec, SM90)
    assert set(fit.configs) == set(spec.configs)  # estimated to fit, none dropped
    for config in (c for c in spec.configs if c["BLOCK_H"] == block_h):
        real = compile_binary(spec, config, SM90).resources
        est = estimate(spec, config, SM90)
        assert real.shared <= est.shared <= SM90.shared_mem_per_block, (config, real, est)
        if config == spec.default:
            assert not real.spills, (config, real)  # the untuned choice does not spill


@pytest.mark.gpu
@pytest.mark.parametrize("heads,block", [(128, 64), (128, None), (16, 64)],
                         ids=["128-paged", "128-contiguous", "16-paged"])
def test_v3_widths_on_cuda_match_the_einsum_form(heads, block):
    """V3's widths in bf16 on a GPU (run by the lead): rows of 14 and 39 keys, the rest
    of a 4096-long cache (contiguous) or of the table's blocks (paged) never read."""
    model, args, ref = _case(H=heads, R=512, P=64, S=4096 if block is None else 256,
                             dtype=torch.bfloat16, block=block)
    args = tuple(x.cuda() for x in args)
    exe = kiln.compile(model, args, target="cuda")
    assert isinstance(exe.program.kplan.kernels[_region(exe.program.plan).name], TritonKernel)
    out = exe(*args)
    assert rel_err(out.cpu(), ref) <= 1e-2, rel_err(out.cpu(), ref)


@pytest.mark.parametrize("context,block_h,parts", [(128, 32, 4), (2048, 32, 16), (8192, 32, 33),
                                                   (2048, 16, 16), (512, 16, 12),
                                                   (65536, 16, 16), (64, 16, 1)])
def test_split_count_balances_keys_against_the_merge(context, block_h, parts):
    """V3's widths in bf16 at batch 1: a merge program reads its 64 columns of every part
    (8 KB a part of 16 heads, as much as 7 cached rows; 14 of 32 heads), so the keys split
    into about sqrt(rows / 7) parts (16 heads), never more than the blocks of 32 keys
    nor than fill the GPU (132 SMs: 16 parts of 8 head blocks, 33 of 4); a tile's merge
    programs (8 chunks, at most one a part; none below merge.SPREAD_MIN parts) come
    after the parts. Context 64 (2 blocks) stays whole: 2 parts would be merged by
    the last alone, which costs more than a block (SERIAL_MIN_BLOCKS)."""
    model, args, _ = _case(B=1, H=128, R=512, P=64, S=context, dtype=torch.bfloat16)
    plan = kiln.compile(model, args, compile_to="dispatch")
    spec = latent.generate(_region(plan), plan, SM90)
    config = next(c for c in spec.configs if c["BLOCK_H"] == block_h and c["BLOCK_N"] == 32
                  and c["KV_SPLIT"] == latent.SPLIT_CAP)
    merges = min(8, parts) if parts >= merge.SPREAD_MIN else 0
    assert spec.grid_for({}, config)[2] == parts + merges  # static sizes: the grid is numbers


@pytest.mark.parametrize("context,parts", [(128, 1), (256, 2)])
def test_a_few_parts_merged_by_the_last_need_long_parts(context, parts):
    """8 query rows (2 x 4) of 16-head tiles fill the GPU at 2 parts (64 tiles, 132
    SMs): with no merge programs (fewer than merge.SPREAD_MIN parts) each part keeps
    at least SERIAL_MIN_BLOCKS blocks of 32 keys, else the tile stays whole."""
    model, args, _ = _case(B=2, Sq=4, H=128, R=512, P=64, S=context, dtype=torch.bfloat16)
    plan = kiln.compile(model, args, compile_to="dispatch")
    spec = latent.generate(_region(plan), plan, SM90)
    config = next(c for c in spec.configs if c["BLOCK_H"] == 16 and c["BLOCK_N"] == 32
                  and c["KV_SPLIT"] == latent.SPLIT_CAP)
    assert spec.grid_for({}, config)[2] == parts


@pytest.mark.parametrize("batch,queries,block_h", [(1, 1, 16), (2, 4, 16), (2, 8, 32)])
def test_untuned_head_block_spreads_a_small_decode(batch, queries, block_h):
    """V3's 128 heads at decode: 32-head tiles at batch 1 are 4 programs before the
    split (an H200 took 16.5 us at context 128 and 46.5 at 2048 against 13.2 and 32.5 with
    16-head tiles); from 16 rows (batch x queries) 32-head tiles are many enough and
    read the cache less."""
    model, args, _ = _case(B=batch, Sq=queries, H=128, R=512, P=64, S=256,
                          dtype=torch.bfloat16)
    plan = kiln.compile(model, args, compile_to="dispatch")
    spec = latent.generate(_region(plan), plan, SM90)
    assert spec.default["BLOCK_H"] == block_h
    assert spec.default.num_warps == (4 if block_h == 16 else 8)
