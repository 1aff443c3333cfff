"""The resource model: shared memory and registers of a kernel at a config, before compiling.

The autotuner and region splitting need to know which configs can fit a target
without paying for a compile each. `estimate(spec, config, target)` predicts the
figures from the template's tile shapes, pipeline stages, element sizes and fused
prologue loads; `fits(resources, target)` checks them (or the real figures read from
a compiled binary) against the target's limits.

The shared-memory rules follow how Triton lays out these kernels; they were fitted
to the real figures of compile-only builds for sm_80, sm_90 and gfx942:
- a tl.dot operand that is loaded in a loop is staged in shared memory, once per
  pipeline stage: `stages` copies with Hopper's wgmma (the async dot reads shared
  memory directly), `stages - 1` with mma.sync / MFMA (one stage is in registers);
  with one stage, operands converted one after another share a buffer;
- a loop-invariant operand (attention's Q tile) is staged once;
- without wgmma, attention's P tile goes through shared memory to become a dot
  operand; with wgmma it stays in registers;
- on CUDA the pipeliner also stages the loop's other loads (a mask tile, the loads of
  a prologue fused into K: RoPE's partner half, cos and sin), one copy per extra
  stage; AMD's stages only dot operands (and the mask).
Registers are estimated from the fp32 accumulators and operand fragments each thread
holds; they are a guide for ordering and pruning, and the binary's own figures decide.
`compare` puts the estimate beside the real figures, which tests keep honest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kiln.codegen.triton.compiler import Resources
from kiln.codegen.triton.spec import Config, KernelSpec
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
    acc = bm * d / threads
    scores = 3 * bm * bn / threads  # the scores, their exponentials, the fp16 copy
    q_frag = bm * d * e / 4 / threads
    return shared, _BASE_REGISTERS + acc + scores + q_frag


_MODELS = {"matmul": _matmul, "attention": _attention}


def violations(res: Resources, target: Target) -> list[str]:
    """Each limit of `target` that `res` exceeds, in words."""
    out = []
    if res.shared > target.shared_mem_per_block:
        out.append(f"{res.shared} B of shared memory > {target.shared_mem_per_block} B")
    if res.registers is not None and res.registers > target.registers_per_thread:
        out.append(f"{res.registers} registers per thread > {target.registers_per_thread}")
    if res.threads > target.max_threads_per_block:
        out.append(f"{res.threads} threads > {target.max_threads_per_block}")
    if res.registers is not None and res.registers * res.threads > target.registers_per_block:
        out.append(f"{res.registers * res.threads} registers per block > "
                   f"{target.registers_per_block}")
    return out


def fits(res: Resources, target: Target) -> bool:
    return not violations(res, target)


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
