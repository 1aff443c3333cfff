"""The resource guarantee (DESIGN.md failure 1): no kernel over its target's limits runs.

A Llama-8B attention kernel with RoPE fused in once needed 286,720 bytes of shared
memory on a 65,536-byte target. Every decision about "does this config fit" is made
here, in one wording, so the autotuner, region splitting and the tests agree:

- `estimate(spec, config, target)`: the figures before compiling, from the template's
  tile shapes, pipeline stages, element sizes and fused prologue loads;
- `violations(res, target)` / `over_limits(res, target)`: each limit an estimate or a
  compiled binary's real figures exceed, in words ("needs N B of shared memory, the
  target has M B");
- `precheck(spec, config, target)`: why a config cannot fit, known before compiling
  (the tuner never spends a compile on it);
- `fitted_spec(region, plan, target, generate)`: the spec with only configs that can
  fit; when the estimates leave nothing sure, the smallest config is compiled
  (compile-only) and its real figures decide; when even that is over the limit, a
  prologue fused into the anchor (RoPE into attention) is split into a region of its
  own (kiln.dispatch.split) and the region is generated again.

The shared-memory rules follow how Triton lays out these kernels; they were fitted
to the real figures of compile-only builds for sm_80, sm_90 and gfx942:
- a tl.dot operand that is loaded in a loop is staged in shared memory, once per
  pipeline stage: `stages` copies with Hopper's wgmma (the async dot reads shared
  memory directly), `stages - 1` with mma.sync / MFMA (one stage is in registers);
  with one stage, operands converted one after another share a buffer;
- a loop-invariant operand (attention's Q tile) is staged once;
- without wgmma, attention's P tile goes through shared memory to become a dot
  operand (laid out for at least 64 rows of fp32 when the tile has fewer); with
  wgmma it stays in registers;
- on CUDA the pipeliner also stages the loop's other loads (a mask tile, the loads of
  a prologue fused into K: RoPE's partner half, cos and sin), one copy per extra
  stage; AMD's stages only dot operands (and the mask).
Registers are estimated from the fp32 accumulators and operand fragments each thread
holds; they are a guide for ordering and pruning, and the binary's own figures decide.
`compare` puts the estimate beside the real figures, which tests keep honest.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kiln.codegen.build.compiler import Resources, compile_binary
from kiln.codegen.build.spec import Config, KernelSpec
from kiln.dispatch import split
from kiln.ir.plan import DispatchPlan, Region
from kiln.target import Target

log = logging.getLogger("kiln.codegen")

_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
_BASE_REGISTERS = 32  # indices, pointers, loop state


def _wgmma(target: Target, block_m: int, config: Config, dtype: str) -> bool:
    """Does Triton use Hopper's warpgroup MMA (operands read from shared memory)?"""
    return (target.backend == "cuda" and isinstance(target.arch, int) and target.arch >= 90
            and block_m >= 64 and config.num_warps % 4 == 0 and dtype != "float32")


def _staged(target: Target, wgmma: bool, stages: int) -> int:
    """How many copies of a loop-loaded dot operand live in shared memory."""
    if stages <= 1:
        return 1
    return stages if wgmma else stages - 1


def estimate(spec: KernelSpec, config: Config, target: Target) -> Resources:
    """Predicted shared memory (bytes) and registers per thread of `spec` at `config`."""
    threads = config.num_warps * target.warp_size
    model = _MODELS.get(spec.template)
    if model is None:
        return Resources(0, _BASE_REGISTERS, None, threads)
    shared, regs = model(spec, config, target, threads)
    return Resources(int(shared), int(regs), None, threads)


def _matmul(spec: KernelSpec, c: Config, target: Target, threads: int):
    meta = spec.meta
    e = _BYTES.get(meta.get("dtype"), 4)
    loads = meta.get("epilogue_loads", 0)
    if meta.get("form") == "gemv":
        bn, bk, mp = c["BLOCK_N"], c["BLOCK_K"], meta.get("m_pad") or 1
        staged = (c.num_stages - 1) * bk * bn * e if c.num_stages > 1 else 0
        regs = (bk * bn + mp * bn + bk) / threads + loads * mp * bn / threads
        return staged, _BASE_REGISTERS + regs
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    tile = (bm * bk + bk * bn) * e
    wgmma = _wgmma(target, bm, c, meta.get("dtype"))
    if e == 4:  # exact fp32 products run on FMA units: operands are converted via shared
        shared = max(1, c.num_stages - 1) * tile
    elif target.backend == "hip":
        shared = max(0, c.num_stages - 1) * tile
    else:
        shared = _staged(target, wgmma, c.num_stages) * tile
    acc = bm * bn / threads
    frags = (bm * bk + bk * bn) * e / 4 / threads
    return shared, _BASE_REGISTERS + acc * (1 + loads) + frags


def _attention(spec: KernelSpec, c: Config, target: Target, threads: int):
    meta = spec.meta
    e = _BYTES.get(meta.get("dtype"), 4)
    d = meta.get("head_dim_pad", 128)
    bm, bn, s = c["BLOCK_M"], c["BLOCK_N"], c.num_stages
    q = bm * d * e
    kv = bn * d * e  # one K or V tile
    p = bm * bn * e
    mask = meta.get("mask_tiles", 0) * bm * bn * 2  # loaded per key step
    prologue = meta.get("prologue_tiles", 0) * kv  # fused prologue loads in the key loop
    wgmma = _wgmma(target, bm, c, meta.get("dtype"))
    if s <= 1:  # nothing is pipelined: K and V take turns in one buffer
        if target.backend == "hip":  # fp32 runs on FMA units: both operands via LDS
            shared = q + kv if e == 4 else max(q, kv)
        else:
            shared = q + kv + (0 if wgmma else p)
    elif target.backend == "hip":  # MFMA; the stream pipeliner stages dot operands only
        shared = max(q, (s - 1) * (2 * kv + mask) + p)
    else:  # cp.async pipelining stages every load of the loop, prologue loads included
        staged = _staged(target, wgmma, s)
        shared = q + staged * (2 * kv + mask) + (s - 1) * prologue + (0 if wgmma else p)
        if not wgmma and bm < 64:
            # Tiles of fewer than 64 query rows convert P through a buffer laid out for
            # 64 rows of fp32: measured on sm_90 with RoPE fused (16 or 32 rows x 64 or
            # 128 keys, 2 stages), the figures exceed the terms above by 4 * bn * (64 - bm).
            shared += 4 * bn * (64 - bm)
    acc = bm * d / threads
    scores = 3 * bm * bn / threads  # the scores, their exponentials, the fp16 copy
    q_frag = bm * d * e / 4 / threads
    return shared, _BASE_REGISTERS + acc + scores + q_frag


def _gated_delta(spec: KernelSpec, c: Config, target: Target, threads: int):
    """The gated delta rule kernel (templates/gated_delta): the dot operands go through
    shared memory as they are converted (keys, W and q as [CHUNK, 64] blocks, the
    [CHUNK, CHUNK] solve and scores, the state as an operand; a second stage
    double-buffers the walk's loads). The sum below is kept as an upper estimate: it
    bounded the compiled figures of the first (whole-key-tile) form of the kernel on
    sm_90 at K = 256 (bf16 81,920-106,496 B at CHUNK 64, 16,384-33,280 B at CHUNK 16),
    and tests/codegen/test_gated_delta.py checks it against the largest candidate of
    the current one compiled for sm_90 (the staged form's roles stay well inside it:
    32,768 B at CHUNK 64, BV 64, K = 256)."""
    meta = spec.meta
    e = _BYTES.get(meta.get("dtype"), 4)
    kp, chunk, bv = meta.get("key_dim_pad", 256), c["CHUNK"], c["BV"]
    shared = 2 * chunk * kp * e + chunk * chunk * 4 + kp * bv * e
    if c.num_stages > 1:  # the one-pass walk's second stage at Qwen3-Next's K = 128 went
        shared += chunk * kp * e  # past the sum (39,168 B bf16, 78,080 B fp32 at CHUNK 32)
    state = kp * bv / threads  # fp32 state block in registers
    tiles = 2 * chunk * kp * e / 4 / threads + 4 * chunk * chunk / threads
    return shared, _BASE_REGISTERS + state + tiles


def _latent_attention(spec: KernelSpec, c: Config, target: Target, threads: int):
    """The latent attention kernel (templates/latent_attention): the q and rope tiles
    [BLOCK_H, R + P] are staged once; per key step the cache tile [BLOCK_N, R + P] is
    a dot operand twice (transposed for the scores, as is for the output). Fitted to
    its compiled figures for sm_90 (R = 512, P = 64, bf16; tests/codegen/
    test_latent_attention.py checks every candidate): with wgmma (64-head blocks) the
    cache tile is staged once per stage (and a split's part goes to memory through
    shared memory, as fp32); with mma.sync, two stages hold one cache tile
    and the P tile, one stage converts the latent twice (an upper estimate)."""
    meta = spec.meta
    e = _BYTES.get(meta.get("dtype"), 4)
    rp, pp = meta.get("latent_dim_pad", 512), meta.get("rope_dim_pad", 64)
    bh, bn, s = c["BLOCK_H"], c["BLOCK_N"], c.num_stages
    q = bh * (rp + pp) * e
    tile = bn * (rp + pp) * e
    if _wgmma(target, bh, c, meta.get("dtype")):
        shared = q + max(1, s) * tile
        if c["KV_SPLIT"] > 1:  # storing a part converts the fp32 accumulator via shared
            shared = max(shared, bh * rp * 4)
    elif s <= 1:
        shared = q + bn * (2 * rp + pp + bh) * e
    else:
        shared = q + (s - 1) * tile + bh * bn * e
    acc = bh * rp / threads
    frags = bh * (rp + pp) * e / 4 / threads + 3 * bh * bn / threads
    return shared, _BASE_REGISTERS + acc + frags


def _fp8_matmul(spec: KernelSpec, c: Config, target: Target, threads: int):
    """The block-scaled fp8 GEMM (templates/fp8_matmul), K steps of 128: each extra
    pipeline stage holds an x tile in x's dtype and an fp8 weight tile; the quantised x
    tile and the transposed weight tile go through shared memory to become wgmma
    operands (without wgmma: two fp8 x-tile buffers). Fitted to sm_90 compile-only
    figures (bf16 and fp32 x, every candidate tile, 2-4 stages: exact), which
    tests/codegen/test_fp8_matmul.py checks. gfx942 stages nothing here: one weight
    tile's layout conversion (measured), plus the x tile's as a margin."""
    e = _BYTES.get(spec.meta.get("dtype"), 4)
    bm, bn, bk = c["BM"], c["BN"], 128
    if spec.meta.get("form") == "gemv":  # CUDA cores: stages nothing (fp8_matmul/gemv.py)
        return _fp8_gemv(c, threads, spec.meta.get("streams", 1))
    if target.backend == "hip":
        return (bm + bn) * bk, _BASE_REGISTERS + (bm * bn + 3 * bm * bk) / threads
    # the swap form (fp8_matmul/template.py) puts the weight rows on the dot's M side
    wgmma = _wgmma(target, bn if spec.meta.get("form") == "swap" else bm, c, "fp8")
    convert = (bm + bn) * bk if wgmma else 2 * bm * bk
    shared = max(1, c.num_stages - 1) * (bm * bk * e + bn * bk) + convert
    regs = (bm * bn + 2 * bm * bk + bn * bk / 4) / threads
    return shared, _BASE_REGISTERS + regs


def _fp8_gemv(c: Config, threads: int, streams: int = 1):
    """The decode GEMV form of the fp8 linear: no staged tiles; shared memory only
    carries each token's quantised [KB, 128] x step and the step's [BN, KB] scales to
    the weight tile's layout, and the tile's sums to the store's (an upper bound:
    sm_90 compiled 512-1024 bytes). Registers: the widened weight step, one fp32 value
    per byte, and each token's accumulator, for each of the `streams` weights a
    program reads (paired siblings: fp8_matmul/grouped.py)."""
    bn, kb = c["BN"], c["KB"]
    step = streams * bn * kb * 128
    shared = 4 * (streams * (bn * kb + bn) + kb * 128)
    return shared, _BASE_REGISTERS + (step + streams * c["BM"] * bn * kb) / threads


def _moe(spec: KernelSpec, c: Config, target: Target, threads: int):
    """The grouped MoE kernel (templates/moe): its two products stage the same bytes
    per K step, the gathered x tile [BM, BK] with the gate and up tiles [BN, BK] each,
    or the h tile with the down tile [BD = 2 BN, BK], and Triton's allocator lets the
    two loops share the buffers. Staged as a matmul's operands are (one copy per stage
    with wgmma, one fewer with mma.sync; fp32 on FMA units through shared memory).
    Exact for every candidate compiled for sm_90 at DeepSeek-V3's widths in bf16 (16-128
    rows, 2-4 stages; tests/codegen/test_moe.py checks them). Registers: the two fp32
    accumulators and the operand fragments."""
    meta = spec.meta
    e = _BYTES.get(meta.get("dtype"), 4)
    bm, bn, bk, stages = c["BM"], c["BN"], c["BK"], c.num_stages
    tile = (bm + 2 * bn) * bk * e
    if e == 4 or target.backend == "hip":
        shared = max(1 if e == 4 else 0, stages - 1) * tile
    else:
        shared = _staged(target, _wgmma(target, bm, c, meta.get("dtype")), stages) * tile
    return shared, _BASE_REGISTERS + (2 * bm * bn + tile / 4) / threads


def _moe_fp8(spec: KernelSpec, c: Config, target: Target, threads: int):
    """The grouped MoE kernel with fp8 experts (templates/moe/fp8.py), K steps of 128:
    each loop stages (num_stages - 1 copies) the gathered x or h tile [BM, 128] in x's
    dtype with the e4m3 weight tiles, 2 BN rows of gate and up or BD = 2 BN of down;
    beside them one [BM, 128] e4m3 tile quantised in registers and, with wgmma, the
    weight tiles once more (wgmma reads both operands from shared memory; mma.sync
    converts the quantised tile through 2 bytes an element). Fitted to every
    candidate compiled for sm_90 at DeepSeek-V3's widths with bf16 x (exact;
    tests/codegen/test_moe_fp8.py checks them with KILN_RUN_SLOW=1). Registers, rough
    and low (sm_90 compiled 128-252, none spilling): the two fp32 accumulators and a
    step's product, and the weight fragments."""
    if spec.meta.get("form") == "gemv":  # CUDA cores: stages nothing (moe/fp8_gemv.py)
        return _moe_fp8_gemv(spec, c, threads)
    e = _BYTES.get(spec.meta.get("dtype"), 4)
    bm, bn, bk = c["BM"], c["BN"], 128
    staged = max(1, c.num_stages - 1) * (e * bm + 2 * bn) * bk
    regs = _BASE_REGISTERS + (3 * bm * bn + bn * bk) / threads
    if target.backend == "hip":
        return staged + bm * bk, regs
    wgmma = _wgmma(target, bm, c, "fp8")
    return staged + ((bm + 2 * bn) * bk if wgmma else 2 * bm * bk), regs


def _moe_fp8_gemv(spec: KernelSpec, c: Config, threads: int):
    """The decode GEMV form of the grouped fp8 MoE: no staged tiles. Shared memory
    only converts layouts, the largest of: a router's [32, k] tile of pointers, a
    row's quantised [KB, 128] step with the step's [BD, KB] scales and the [BD]
    sums (an upper bound: sm_90 compiled 512-2048 bytes at V3's widths, the
    router's tile the largest). Registers: the widened weight step, one fp32 value
    per byte, and each row's 16 values of the quantised step (rough: sm_90 compiled
    72-199 over the config space)."""
    bd, kb, kp = c["BD"], c["KB"], 1 << max(0, (spec.meta.get("top_k", 1) - 1).bit_length())
    shared = max(8 * 32 * kp, 4 * (bd * kb + kb * 128 + bd))
    return shared, _BASE_REGISTERS + bd * kb * 128 / threads + 16 * c["BM"]


def _fp8_gemm(spec: KernelSpec, c: Config, target: Target, threads: int):
    """The block-scaled fp8 GEMM on quantised x (templates/fp8_matmul/gemm.py), K steps
    of 128: every stage holds a [BM, 128] x tile and a [128, BN] weight tile, both
    e4m3 (wgmma reads them from shared memory; without it Triton stages one copy
    fewer); a 256-column tile's [BN] weight scales go through shared memory once.
    Fitted to sm_90 compile-only figures (every candidate: exact), which
    tests/codegen/test_fp8_matmul.py checks. Registers: the accumulator and one
    step's product, each [BM, BN] fp32, and the operand fragments."""
    bm, bn, bk = c["BM"], c["BN"], 128
    wgmma = _wgmma(target, bm, c, "fp8")
    shared = _staged(target, wgmma, c.num_stages) * (bm + bn) * bk
    if bn > bk:
        shared += 4 * bn
    if spec.meta.get("tma"):  # an mbarrier a stage tells the loads' arrival
        shared += 8 * c.num_stages
    regs = (2 * bm * bn + (bm + bn) * bk / 4) / threads
    return shared, _BASE_REGISTERS + regs


_MODELS = {"matmul": _matmul, "attention": _attention, "gated_delta": _gated_delta,
           "latent_attention": _latent_attention, "fp8_matmul": _fp8_matmul, "moe": _moe,
           "fp8_gemm": _fp8_gemm, "moe_fp8": _moe_fp8}


def violations(res: Resources, target: Target) -> list[str]:
    """Each limit of `target` that `res` (estimated or real) exceeds, in words."""
    out = []
    if res.shared > target.shared_mem_per_block:
        out.append(f"needs {res.shared} B of shared memory, the target has "
                   f"{target.shared_mem_per_block} B")
    if res.threads and res.threads > target.max_threads_per_block:
        out.append(f"needs {res.threads} threads per block, the target allows "
                   f"{target.max_threads_per_block}")
    if res.registers is not None:
        if res.registers > target.registers_per_thread:
            out.append(f"needs {res.registers} registers per thread, the target has "
                       f"{target.registers_per_thread}")
        if res.threads and res.registers * res.threads > target.registers_per_block:
            out.append(f"needs {res.registers * res.threads} registers per block, the "
                       f"target has {target.registers_per_block}")
    return out


def over_limits(res: Resources, target: Target) -> str | None:
    """Why `res` does not fit `target` (every limit it exceeds), or None when it fits."""
    return "; ".join(violations(res, target)) or None


def fits(res: Resources, target: Target) -> bool:
    return not violations(res, target)


def precheck(spec: KernelSpec, config: Config, target: Target,
             estimator=None) -> str | None:
    """Why `config` cannot fit `target`, known before compiling; None when it may fit.

    Only threads and estimated shared memory are trusted before compiling: register
    estimates are rough, and too many registers spill rather than fail. `estimator`
    (default `estimate`) returns an object with `shared` (bytes); one that fails is
    ignored, and the real figures after compiling decide.
    """
    threads = config.num_warps * target.warp_size
    if threads > target.max_threads_per_block:
        return over_limits(Resources(0, None, None, threads), target)
    try:
        shared = int((estimator or estimate)(spec, config, target).shared)
    except Exception as e:  # an estimate is an optimisation; compiling still decides
        log.debug("no resource estimate for %s [%s]: %s", spec.name, config, e)
        return None
    why = over_limits(Resources(shared, None, None, threads), target)
    return f"estimated: {why}" if why else None


def compare(est: Resources, real: Resources) -> str:
    """The estimate beside the compiler's figures, for logs and notes."""
    return (f"shared est {est.shared} B / real {real.shared} B, registers est "
            f"{est.registers} / real {real.registers}")


@dataclass
class Fit:
    """The configs of a spec that can fit a target, or what the smallest one needs."""

    configs: list[Config]  # estimated to fit, most preferred first
    smallest: Config  # the config with the least estimated shared memory
    smallest_estimate: Resources


def fitting_configs(spec: KernelSpec, target: Target) -> Fit:
    """Split `spec.configs` by the model: those estimated to fit, in the spec's order."""
    ests = {c: estimate(spec, c, target) for c in _unique([spec.default, *spec.configs])}
    # Before compiling only shared memory and threads decide (as in the autotuner):
    # too many registers spill rather than fail, and the binary's figures say so.
    ok = [c for c, r in ests.items()
          if fits(Resources(r.shared, None, None, r.threads), target)]
    smallest = min(ests, key=lambda c: (ests[c].shared, ests[c].registers or 0))
    return Fit(ok, smallest, ests[smallest])


def _unique(configs: list[Config]) -> list[Config]:
    return list(dict.fromkeys(configs))


# Estimates below this share of the limit are trusted without a confirming compile.
TRUSTED_SHARE = 0.75
# Which prologue comes out first: operands read in the key loop cost once per stage.
_SPLIT_ORDER = {"key": 0, "value": 1, "attn_mask": 2, "query": 3}

Generator = Callable[[Region, DispatchPlan, Target], KernelSpec]


def fitted_spec(region: Region, plan: DispatchPlan, target: Target,
                generate: Generator) -> KernelSpec | None:
    """`generate`'s spec for `region`, keeping only configs that can fit `target`.

    May split `region` (adding regions to `plan` before it). None when no config of
    this template can fit, even split; `region.notes` then says why. A template that
    declines raises CodegenUnsupported from `generate`, which passes through.
    """
    while True:
        spec = generate(region, plan, target)
        if not target.is_gpu:
            return spec
        spec, why = _fit(spec, target)
        if spec is not None:
            return spec
        operand = _next_split(region)
        if operand is None:
            region.notes.append(f"extern: {why}")
            return None
        split.split_prologue(plan, region, operand, why)


def _next_split(region: Region) -> str | None:
    operands = split.splittable_operands(region)
    if not operands:
        return None
    anchor = region.anchor()
    return min(operands, key=lambda o: _SPLIT_ORDER.get(split.operand_role(anchor, o), 9))


def _fit(spec: KernelSpec, target: Target) -> tuple[KernelSpec | None, str]:
    fit = fitting_configs(spec, target)
    limit = target.shared_mem_per_block
    trusted = [c for c in fit.configs
               if estimate(spec, c, target).shared <= TRUSTED_SHARE * limit]
    if trusted:
        return _keep(spec, fit.configs), ""
    config = fit.smallest
    try:
        real = compile_binary(spec, config, target).resources
    except Exception as e:  # a compiler failure is the tuner's to record, not a size verdict
        log.info("could not confirm %s [%s]: %s", spec.name, config, e)
        return (_keep(spec, fit.configs), "") if fit.configs else (None, f"[{config}]: {e}")
    log.info("%s [%s]: %s", spec.name, config, compare(fit.smallest_estimate, real))
    over = violations(real, target)
    if not over:
        return _keep(spec, [config] + [c for c in fit.configs if c != config]), ""
    why = (f"on {target} the smallest config of its {spec.template} kernel [{config}] "
           + "; ".join(over))
    return None, why


def _keep(spec: KernelSpec, configs) -> KernelSpec:
    default = spec.default if spec.default in configs else configs[0]
    return dataclasses.replace(spec, configs=list(configs), default=default)
