"""What a mixture-of-experts region computes, read off its kiln::moe_experts op or
its fp8 form kiln::moe_experts_fp8 (e4m3 experts with 128 x 128 block scales).

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
from kiln.ops.moe_experts import routing_bound

OP = "kiln.moe_experts.default"
FP8_OP = "kiln.moe_experts_fp8.default"
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)
MAX_TOP_K = 64  # a program holds a token's k choices in one [rows, k] tile


@dataclass
class MoeShape:
    """What the kernel computes, read off the region's moe_experts op."""

    x: str  # operand value names (region inputs or ops)
    weights: str
    ids: str
    gate: str
    up: str
    down: str
    out: str
    tokens: Dim  # N
    top_k: int  # k
    experts: int  # E
    inter: int  # I, each expert's width
    dim: int
    dtype: torch.dtype  # x's and the output's (and the weights', but for fp8 experts)
    scales: tuple[str, str, str] | None = None  # fp8: gate's, up's and down's block scales

    @property
    def fp8(self) -> bool:
        return self.scales is not None

    @property
    def pairs(self) -> Dim:
        """N * k (token, expert) pairs: the sorted row buffer's size, and the bound on
        every expert's rows."""
        return routing_bound(self.tokens, self.top_k)


def analyse(region: Region, plan: DispatchPlan) -> MoeShape:
    """The region's op; raises CodegenUnsupported (why) when the template cannot run it."""
    anchor = region.anchor()
    if anchor.target not in (OP, FP8_OP):
        raise CodegenUnsupported(f"the region's extern op is {anchor.target}, not {OP} "
                                 f"or {FP8_OP}")
    if region.outputs != [anchor.name]:
        raise CodegenUnsupported("the region's outputs are not its moe_experts op alone")
    fp8 = anchor.target == FP8_OP
    names = (("x", "weights", "ids", "gate", "gate_scale", "up", "up_scale", "down",
              "down_scale") if fp8 else ("x", "weights", "ids", "gate", "up", "down"))
    args = list(anchor.args)
    for name, a in zip(names, args, strict=True):
        if not isinstance(a, Ref):
            raise CodegenUnsupported(f"{name} is not a tensor")
    refs = dict(zip(names, (a.name for a in args), strict=True))
    x, weights, ids, gate, up, down = (refs[n] for n in ("x", "weights", "ids", "gate",
                                                         "up", "down"))
    N, dim = _shape(region, plan, x)
    k = _shape(region, plan, ids)[1]
    E, inter, _ = _shape(region, plan, gate)
    if not all(isinstance(v, int) for v in (dim, k, E, inter)):
        raise CodegenUnsupported("symbolic expert counts or widths")
    if k > MAX_TOP_K:
        raise CodegenUnsupported(f"{k} experts per token (at most {MAX_TOP_K})")
    dtype = _dtype(region, plan, x)
    want = torch.float8_e4m3fn if fp8 else dtype
    if dtype not in _FLOATS or any(_dtype(region, plan, w) != want for w in (gate, up, down)):
        raise CodegenUnsupported("activations and experts of different or non-float dtypes")
    if _dtype(region, plan, weights) != torch.float32:
        raise CodegenUnsupported("routing weights that are not float32")
    if _dtype(region, plan, ids) not in _INTS:
        raise CodegenUnsupported("expert ids that are not int32 / int64")
    scales = None
    if fp8:
        scales = tuple(refs[f"{n}_scale"] for n in ("gate", "up", "down"))
        for name in (gate, up, down, *scales):
            if name not in region.inputs:
                raise CodegenUnsupported(f"%{name} is computed in the region (the fp8 "
                                         "kernel reads stored experts and scales in place)")
        if any(_dtype(region, plan, sc) != torch.float32 for sc in scales):
            raise CodegenUnsupported("block scales that are not float32")
    return MoeShape(x, weights, ids, gate, up, down, anchor.name, N, k, E, inter, dim, dtype,
                    scales)


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
