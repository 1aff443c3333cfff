"""The latent attention template: one Triton kernel for a region holding kiln::latent_attention.

The op (kiln.ops.latent_attention) is MLA's absorbed attention: every head attends to
the same cached rows, the row (latent R + rotary key P) as its key and the latent as
its value. A decode step is bound by reading the cache (V3: 576 numbers per token per
layer), so the kernel reads each cache block once for a block of heads:

- a program takes one query (batch row b, query t) and BLOCK_H heads: its q tile
  [BLOCK_H, R] and rope tile [BLOCK_H, P] stay in registers; per BLOCK_N keys it
  loads the latent [BLOCK_N, R] and rotary key [BLOCK_N, P] once and uses the latent
  twice, as keys (scores = q kv^T + qr kr^T, two tl.dot in 16 bits) and as values
  (acc += p kv); online softmax in fp32 (exp2, running max and sum);
- keys stop at the query's position (input_pos[b, t]): a row never reads past its
  context, however long the cache (contiguous max_seq_len, or the table's blocks);
- paged: key s is at block_table[b, s // block_size], s % block_size, the table read
  once per key step; contiguous: at [b, s];
- when batch x queries x head blocks are too few to fill the GPU (decode at batch 1:
  V3's 128 heads are 4 to 8 programs), the keys are split across programs
  (kiln.codegen.templates.split_k, flash-decoding): each part stores its unnormalised
  output with its max and sum, and the last to arrive merges the parts that had keys.

Operands are read through the region's fused views by the expression emitter (the
cache's two parts are slices of one buffer, read in place). Widths come from the
shapes (padded to powers of two, masked), so tiny test models run the same kernel.
"""

from __future__ import annotations

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.latent_attention.analysis import OP, LatentShape, analyse, pow2
from kiln.codegen.templates.latent_attention.body import LatentBody
from kiln.codegen.templates.matmul.configs import can_split
from kiln.ir.plan import DispatchPlan, Region
from kiln.target import Target

__all__ = ["OP", "config_space", "generate", "heuristic"]

HEAD_BLOCKS = (64, 32, 16)
KEY_BLOCKS = (64, 32, 16)
MIN_SPLIT_BLOCKS = 2  # key blocks a split gets at least
SPLIT_CAP = 32  # most parts the keys are split into
MAX_ACC_REGISTERS = 64  # fp32 accumulator elements per thread a config may hold
WARPS = (4, 8)  # 16 warps leave 128 registers a thread: spilled at R = 512


def config_space(shape: LatentShape) -> list[Config]:
    """Head blocks, key blocks, stages and splitting or not, most heads per program
    first (each head block reads the cache once more).

    Each head block gets the fewest warps that hold its fp32 accumulator in at most
    MAX_ACC_REGISTERS a thread (BLOCK_H x R / threads), and key tiles are at most 16 K
    elements (BLOCK_N x R): compiled for sm_90 at V3's R = 512, more than either spilled
    (the q tile is held in registers too). A split needs room for the accumulator and
    a part at once (matmul.configs.can_split)."""
    rp = pow2(shape.latent_dim)
    heads = [h for h in HEAD_BLOCKS if h <= pow2(shape.heads)] or [16]
    keys = [n for n in KEY_BLOCKS if n * rp <= 16 * 1024] or [16]
    configs = []
    for bh in heads:
        warps = next((w for w in WARPS if bh * rp / (w * 32) <= MAX_ACC_REGISTERS), None)
        if warps is None:
            continue
        for bn in keys:
            for stages in (2, 1):
                for cap in (SPLIT_CAP, 1) if can_split(bh * rp, warps) else (1,):
                    configs.append(Config.make(warps, stages, BLOCK_H=bh, BLOCK_N=bn,
                                               KV_SPLIT=cap))
    return configs


def heuristic(shape: LatentShape, target: Target) -> Config:
    """The untuned choice: 16 heads per program with 4 warps at V3's widths (a
    [32, 512] key tile, two stages, 64 accumulator registers a thread; compiled for
    sm_90 without spilling), so that a 128-head decode has 8 head blocks per query and
    still splits its keys; 32 heads at narrower latents. The interpreter runs one stage."""
    rp = pow2(shape.latent_dim)
    bh = 16 if rp >= 512 or shape.heads <= 16 else 32
    warps = next(w for w in WARPS if bh * rp / (w * 32) <= MAX_ACC_REGISTERS)
    bn = 32 if rp >= 256 else 64
    stages = 1 if target.backend == "interpret" else 2
    cap = SPLIT_CAP if can_split(bh * rp, warps) else 1
    return Config.make(warps, stages, BLOCK_H=bh, BLOCK_N=bn, KV_SPLIT=cap)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The latent attention kernel of `region`; raises CodegenUnsupported saying why not."""
    shape = analyse(region, plan)
    p = SymbolicArgs(plan.symbols)
    em = Emitter(region, plan, p, target)
    for name in list(region.inputs) + list(region.outputs):
        p.check_extent(plan.values[name].numel)
    lines = LatentBody(em, p, shape).lines()
    name = kernel_name("latent_attention", region)
    tunables = ["BLOCK_H", "BLOCK_N", "KV_SPLIT"]
    params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr" for t in tunables]
    source = module_source(name, params, lines, em.helpers, target, p.describe())
    head_blocks = f"cdiv({shape.heads}, BLOCK_H)"
    queries = p.grid(shape.batch * shape.tq)
    tiles = f"{head_blocks} * {queries}"
    n_split = split.count("KV_SPLIT", tiles, target.multiprocessors,
                          f"cdiv({p.grid(shape.keys)}, {MIN_SPLIT_BLOCKS} * BLOCK_N)")
    configs = config_space(shape)
    default = heuristic(shape, target)
    if default not in configs:
        configs.insert(0, default)
    rp = pow2(shape.latent_dim)
    meta = {"latent_dim": shape.latent_dim, "rope_dim": shape.rope_dim,
            "latent_dim_pad": rp, "rope_dim_pad": pow2(shape.rope_dim),
            "heads": shape.heads, "paged": shape.paged,
            "dtype": str(shape.dtype).replace("torch.", "")}
    return KernelSpec(name, source, p.args(), tunables, (head_blocks, queries, n_split),
                      configs, default, "latent_attention", meta,
                      64 if p.needs_int64 else 32,
                      scratch=split.scratch(tiles, n_split, f"BLOCK_H * {rp + 2}"))
