"""What a gated delta rule region computes, read off its kiln::gated_delta_rule op.

`analyse` says why the template declines (CodegenUnsupported) for what it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.gated_delta.step_fusion import StateStore, state_store
from kiln.codegen.templates.op_operands import operand_dtype as _dtype
from kiln.codegen.templates.op_operands import operand_shape as _shape
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import Dim, same_dim

OP = "kiln.gated_delta_rule.default"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_KEY_DIM = 256  # the state's [K, BV] block is held in registers


@dataclass
class DeltaShape:
    """What the kernel computes, read off the region's gated_delta_rule op."""

    q: str  # operand value names (region inputs or ops)
    k: str
    v: str
    g: str
    beta: str
    initial_state: str | None
    cu_seqlens: str | None
    out: str | None  # region output holding o (getitem 0), None when nothing reads it
    final_state: str | None  # region output holding the final state (getitem 1)
    scale: float
    batch: Dim
    seq: Dim  # T
    sequences: Dim  # N: the batch, or the packed sequences
    heads: int  # H (q, k)
    value_heads: int  # HV
    key_dim: int
    value_dim: int
    dtype: torch.dtype  # q and k's (the dots' operand type)
    # the final state (getitem 1, then not an output) written into the recurrent state by
    # an in-place scatter of the region (step_fusion.py)
    final_store: StateStore | None = None
    final_op: str | None = None  # getitem 1, output or not
    out_op: str | None = None  # getitem 0, output or not
    # outputs computed from o per element of o (a gated RMSNorm over each value head:
    # step_fusion.py), stored where o is
    epilogue: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        return self.value_heads // self.heads

    @property
    def static_t(self) -> int | None:
        return self.seq if isinstance(self.seq, int) and self.cu_seqlens is None else None


def analyse(region: Region, plan: DispatchPlan) -> DeltaShape:
    """The region's op; raises CodegenUnsupported (why) when the template cannot run it."""
    anchor = region.anchor()
    if anchor.target != OP:
        raise CodegenUnsupported(f"the region's extern op is {anchor.target}, not {OP}")
    args = list(anchor.args) + [None] * (8 - len(anchor.args))
    q, k, v, g, beta, scale, state, cu = args[:8]
    for name, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(a, Ref):
            raise CodegenUnsupported(f"{name} is not a tensor")
    if not isinstance(scale, float | int):
        raise CodegenUnsupported("a scale that is not a number")
    outs = {}
    for op in region.ops:
        if op.target == "getitem" and op.args and op.args[0] == Ref(anchor.name):
            outs[op.args[1]] = op.name
    store = state_store(region, outs[1]) if 1 in outs else None
    B, T, H, K = _shape(region, plan, q.name)
    HV, V = _shape(region, plan, v.name)[2:]
    extra = tuple(o for o in region.outputs
                  if o not in outs.values() and (store is None or o != store.op))
    o_shape = (B, T, HV, V)
    if any(0 not in outs or len(region.op(o).shape) != 4
           or not all(same_dim(a, b) for a, b in zip(region.op(o).shape, o_shape))
           for o in extra):
        raise CodegenUnsupported(f"the region also outputs {list(extra)}, not the op's "
                                 "results or values shaped as its output")
    if not all(isinstance(x, int) for x in (H, K, HV, V)):
        raise CodegenUnsupported("symbolic head counts or head dims")
    if K > MAX_KEY_DIM or V > 4 * MAX_KEY_DIM:
        raise CodegenUnsupported(f"key dim {K} / value dim {V}: the state block would not "
                                 "fit in registers")
    dtype = _dtype(region, plan, q.name)
    if dtype not in _FLOATS or _dtype(region, plan, k.name) != dtype:
        raise CodegenUnsupported(f"q and k of dtypes {dtype} / "
                                 f"{_dtype(region, plan, k.name)}")
    if any(_dtype(region, plan, x.name) not in _FLOATS for x in (v, g, beta)):
        raise CodegenUnsupported("v, g or beta of a dtype Triton does not multiply")
    if isinstance(state, Ref) and _dtype(region, plan, state.name) not in _FLOATS:
        raise CodegenUnsupported("an initial state that is not floating point")
    sequences = B
    if isinstance(cu, Ref):
        sequences = _shape(region, plan, cu.name)[0] - 1
    if not same_dim(_shape(region, plan, k.name)[1], T):
        raise CodegenUnsupported("k's length differs from q's")
    return DeltaShape(q.name, k.name, v.name, g.name, beta.name,
                      state.name if isinstance(state, Ref) else None,
                      cu.name if isinstance(cu, Ref) else None,
                      outs.get(0) if outs.get(0) in region.outputs else None,
                      outs.get(1) if outs.get(1) in region.outputs else None,
                      float(scale), B, T, sequences, H, HV, K, V, dtype, store, outs.get(1),
                      outs.get(0), extra)


def pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())
