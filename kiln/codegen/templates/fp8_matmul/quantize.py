"""The activation quantisation kernel, for a region holding kiln::fp8_quantize.

x [..., K] (fp16/bf16/fp32) -> e4m3fn values [..., K] and fp32 scales [..., K/128]:
per token, each 128-wide group times 448 / amax, its scale amax / 448, exactly as
kiln.ops.fp8_linear.quantize_activations (common.quantise_rows). The split form of an
fp8 linear runs it once before the GEMM (gemm.py), which then reads fp8 tiles.

A program quantises a [BM, 128] tile: one group of BM tokens. It reads x once and
writes a byte per element plus a scale per group, so it is bound by memory; BM picks
how much each program moves. x is read through the region's index maps by the
expression emitter (a 3-D x is read in place); K's tail group is masked.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.indexing import Lin, Var, reshape_index
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, mask_of
from kiln.codegen.templates.fp8_matmul.analysis import (
    BLOCK,
    QUANTIZE_OP,
    QuantShape,
    analyse_quantize,
)
from kiln.codegen.templates.fp8_matmul.common import E4M3FN, fp8_type, pow2, quantise_rows
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

__all__ = ["QUANTIZE_OP", "config_space", "generate", "heuristic"]

BLOCK_M = (8, 16, 32, 64)


def config_space(m_hi: int | None) -> list[Config]:
    """Tokens per program; no more than there can be tokens. Nothing loops, so one
    stage; 4 warps hold a [64, 128] tile in 64 values a thread."""
    most = None if m_hi is None else max(BLOCK_M[0], pow2(m_hi))
    return [Config.make(4, 1, BM=bm) for bm in BLOCK_M if most is None or bm <= most]


def heuristic(target: Target, m_hi: int | None) -> Config:
    """32 tokens a program (8 KB of bf16 x); the interpreter runs 8."""
    if target.backend == "interpret":
        return Config.make(4, 1, BM=8)
    return Config.make(4, 1, BM=min(32, max(8, pow2(m_hi or 32))))


def _v(name: str, size) -> Lin:
    return Lin.of(Var(name, size, True))


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The quantisation kernel of `region`; raises CodegenUnsupported saying why not."""
    shape = analyse_quantize(region, plan)
    fp8_type(target)  # declines before any code is emitted
    p = SymbolicArgs(plan.symbols)
    em = Emitter(region, plan, p, target)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    lines = _body(em, p, shape, target)
    name = kernel_name("fp8_quantize", region)
    params = p.names() + ["BM: tl.constexpr"]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    grid = (f"cdiv({p.grid(shape.m)}, BM)", str(shape.k_blocks))
    m_hi = bounds_of(shape.m, plan.symbols).hi
    configs = config_space(m_hi)
    default = heuristic(target, m_hi)
    if default not in configs:
        configs.insert(0, default)
    meta = {"dtype": str(shape.dtype).replace("torch.", ""), "m_hi": m_hi, "k": shape.k}
    return KernelSpec(name, source, p.args(), ["BM"], grid, configs, default,
                      "fp8_quantize", meta, 64 if p.needs_int64 else 32)


def _body(em: Emitter, p: SymbolicArgs, s: QuantShape, target: Target) -> list[str]:
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    M, K = p.dim(s.m), s.k
    m_ok, k_ok = Cond("m_ok", frozenset({"om"})), Cond("ok < K", frozenset({"ok"}))
    x_idx = reshape_index((_v("om", s.m), _v("ok", s.k)), (s.m, s.k), s.x_shape)
    xq = p.tensor(s.xq, torch.float8_e4m3fn, s.x_shape, output=True)
    xs = p.tensor(s.xs, torch.float32, (*s.x_shape[:-1], s.k_blocks), output=True)
    tail = K % BLOCK != 0
    lines = [f"K = {K}", f"pid_m = tl.program_id(0){wide}", "kb = tl.program_id(1)",
             "rm = pid_m * BM + tl.arange(0, BM)", "om = rm[:, None]  # [BM, 1] tokens",
             f"ok = kb * {BLOCK} + tl.arange(0, {BLOCK})[None, :]  # [1, 128] this group",
             f"m_ok = om < {M}"]
    with em.block() as load:
        x = em.value(s.x, x_idx, mask_of(m_ok, k_ok if tail else None))
    keep = "m_ok & (ok < K)" if tail else "m_ok"
    stored = "xq" if target.backend != "hip" else f"xq.to({E4M3FN}, bitcast=True)"
    return lines + load + [
        f"xf = tl.where({keep}, {x.code}.to(tl.float32), 0.0)",
        *quantise_rows("xf", target),
        f"tl.store({xq} + om * K + ok, {stored}, mask={keep})",
        f"tl.store({xs} + rm * {s.k_blocks} + kb, xs, mask=rm < {M})",
    ]
