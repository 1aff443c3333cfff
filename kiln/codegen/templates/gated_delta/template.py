"""The gated delta rule template: one Triton kernel for a region holding kiln::gated_delta_rule.

The op (kiln.ops.gated_delta_rule) is an extern op: torch.export keeps it whole and on
the CPU it runs as its chunked PyTorch form. On Triton targets this template generates
its kernel instead. One launch covers the whole op, so it fits one KernelSpec:

- a program owns one (sequence, value head, block of BV value columns); the [K, BV]
  slice of the fp32 state lives in registers for the whole sequence, and is read once
  (initial state) and written once (final state);
- a sequence longer than one step is walked chunk by chunk (CHUNK steps, a tunable): per
  chunk the gate's cumulative sum, the intra-chunk solve (I + A)^-1 by forward
  substitution on the [CHUNK, CHUNK] tile, the chunk's outputs and the state update,
  all in registers (the math is kiln.ops.gated_delta_rule's docstring). A tail shorter
  than CHUNK is masked: its steps load beta = 0 and g = 0, which leave the state as it is;
- a sequence of one step (decode) takes the recurrence directly: S = S exp(g);
  u = beta (v - S^T k); S += k u^T; o = S^T (scale q). When T is a static 1 only that
  path is generated; when it is a static T > 1 only the chunked one; otherwise (dynamic
  T, packed sequences) the kernel branches per sequence.

q, k, v, g, beta and the initial state are read through the region's fused views by the
expression emitter (a q that is a slice of a projection is read in place); cu_seqlens
(packed sequences) gives each program its sequence's bounds. Value head j reads key
head j // (HV // H). Loads of 16-bit inputs stay 16-bit for tl.dot (fp32 accumulation);
fp32 inputs multiply in IEEE fp32. The configs span CHUNK, BV and num_warps 4, 8 and 16
(the warps that once crashed Triton's compiler on flash-linear-attention's kernel: the
autotuner quarantines such a config and tunes the rest).
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.templates.gated_delta.analysis import OP, DeltaShape, analyse, pow2
from kiln.codegen.templates.gated_delta.body import body
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of
from kiln.target import Target

__all__ = ["OP", "config_space", "generate", "heuristic"]

CHUNKS = (64, 32, 16)
VALUE_BLOCKS = (64, 32, 16)
WARPS = (4, 8, 16)


def config_space(shape: DeltaShape) -> list[Config]:
    """Chunk sizes, value blocks and warps, largest work per program first. A static
    one-step op has no chunks: its configs differ only in BV and warps."""
    vp = pow2(shape.value_dim)
    blocks = [b for b in VALUE_BLOCKS if b <= vp] or [16]
    t_hi = shape.static_t
    chunks = [16] if t_hi == 1 else [c for c in CHUNKS if t_hi is None or c <= pow2(t_hi)]
    if shape.dtype == torch.float32:  # exact fp32 dots run on FMA units: 64-step chunks
        chunks = [c for c in chunks if c <= 32]  # took 95 s to compile and spilled
    return [Config.make(w, 1, CHUNK=c, BV=bv) for c in chunks for bv in blocks for w in WARPS]


def heuristic(shape: DeltaShape, target: Target) -> Config:
    """The untuned choice (timed tuning tries its neighbours). The interpreter runs small
    chunks fastest. On a GPU the [CHUNK, K] q and k tiles and the state block compete for
    registers: compiled for sm_90 at K = 256, bf16, 8 warps, BV = 32 spills 222
    registers at CHUNK 64, 252 at 32 and 2 at 16; 8 warps hold a [256, 32] fp32 state
    block in 32 registers per thread. Smaller keys take longer chunks (fewer steps)."""
    kp = pow2(shape.key_dim)
    longest = max(c["CHUNK"] for c in config_space(shape))
    chunk = 16 if target.backend == "interpret" or kp >= 256 else 32 if kp >= 128 else 64
    bv = min(32, pow2(shape.value_dim))
    warps = 4 if kp * bv <= 64 * 64 else 8
    return Config.make(warps, 1, CHUNK=min(chunk, longest), BV=bv)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The gated delta rule kernel of `region`; raises CodegenUnsupported saying why not."""
    shape = analyse(region, plan)
    p = SymbolicArgs(plan.symbols)
    em = Emitter(region, plan, p, target)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    lines = body(em, p, shape)
    name = kernel_name("gated_delta", region)
    tunables = ["CHUNK", "BV"]
    params = p.names() + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    grid = (f"cdiv({p.grid(shape.value_dim)}, BV)", p.grid(shape.value_heads),
            p.grid(shape.sequences))
    configs = config_space(shape)
    default = heuristic(shape, target)
    if default not in configs:
        configs.insert(0, default)
    hi = bounds_of(shape.seq, plan.symbols).hi if shape.cu_seqlens is None else None
    meta = {"key_dim": shape.key_dim, "value_dim": shape.value_dim,
            "key_dim_pad": pow2(shape.key_dim),
            "dtype": str(shape.dtype).replace("torch.", ""),
            "chunked": shape.static_t != 1, "seq_hi": hi}
    return KernelSpec(name, source, p.args(), tunables, grid, configs, default,
                      "gated_delta", meta, 64 if p.needs_int64 else 32)
