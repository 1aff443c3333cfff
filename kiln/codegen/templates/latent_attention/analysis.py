"""What a latent attention region computes, read off its kiln::latent_attention op.

`analyse` says why the template declines (CodegenUnsupported) for what it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.op_operands import operand_dtype as _dtype
from kiln.codegen.templates.op_operands import operand_shape as _shape
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import Dim

OP = "kiln.latent_attention.default"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)
MAX_WIDTH = 1024  # a program's [BLOCK_H, R] fp32 accumulator is held in registers


@dataclass
class LatentShape:
    """What the kernel computes, read off the region's latent_attention op."""

    q_latent: str  # operand value names (region inputs or ops)
    q_rope: str
    kv_latent: str
    k_rope: str
    input_pos: str
    block_table: str | None  # None: the contiguous layout
    out: str
    scale: float
    batch: Dim
    tq: Dim  # queries per row (1 in decode)
    heads: int
    latent_dim: int  # R
    rope_dim: int  # P
    cache_rows: Dim  # contiguous: rows of the cache; paged: blocks of the pool
    cache_len: Dim  # contiguous: S; paged: block_size
    table_width: Dim | None  # paged: blocks per batch row
    dtype: torch.dtype

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def keys(self) -> Dim:
        """Keys a batch row can have: the contiguous length, or the table's reach."""
        return self.cache_len * self.table_width if self.paged else self.cache_len


def analyse(region: Region, plan: DispatchPlan) -> LatentShape:
    """The region's op; raises CodegenUnsupported (why) when the template cannot run it."""
    anchor = region.anchor()
    if anchor.target != OP:
        raise CodegenUnsupported(f"the region's extern op is {anchor.target}, not {OP}")
    if region.outputs != [anchor.name]:
        raise CodegenUnsupported("the region's outputs are not its latent_attention op alone")
    args = list(anchor.args) + [None] * (7 - len(anchor.args))
    q_latent, q_rope, kv, kr, pos, scale, table = args[:7]
    for name, a in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_latent", kv),
                    ("k_rope", kr), ("input_pos", pos)):
        if not isinstance(a, Ref):
            raise CodegenUnsupported(f"{name} is not a tensor")
    if not isinstance(scale, float | int):
        raise CodegenUnsupported("a scale that is not a number")
    B, Tq, H, R = _shape(region, plan, q_latent.name)
    P = _shape(region, plan, q_rope.name)[-1]
    rows, length, _ = _shape(region, plan, kv.name)
    if not all(isinstance(x, int) for x in (H, R, P)):
        raise CodegenUnsupported("symbolic head counts or widths")
    if R > MAX_WIDTH or P > MAX_WIDTH:
        raise CodegenUnsupported(f"latent width {R} + {P}: the accumulator would not fit "
                                 "in registers")
    dtype = _dtype(region, plan, q_latent.name)
    if dtype not in _FLOATS or any(_dtype(region, plan, x.name) != dtype
                                   for x in (q_rope, kv, kr)):
        raise CodegenUnsupported("queries and cache of different or non-float dtypes")
    if _dtype(region, plan, pos.name) not in _INTS:
        raise CodegenUnsupported("input_pos that is not int32 / int64")
    width = None
    if isinstance(table, Ref):
        if _dtype(region, plan, table.name) not in _INTS:
            raise CodegenUnsupported("a block table that is not int32 / int64")
        width = _shape(region, plan, table.name)[1]
    return LatentShape(q_latent.name, q_rope.name, kv.name, kr.name, pos.name,
                       table.name if isinstance(table, Ref) else None, anchor.name,
                       float(scale), B, Tq, H, R, P, rows, length, width, dtype)


def pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())
