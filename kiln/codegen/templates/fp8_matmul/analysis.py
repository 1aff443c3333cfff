"""What an fp8 linear region computes, read off its kiln::fp8_linear op.

`analyse` says why the template declines (CodegenUnsupported) for what it cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.expr.values import CodegenUnsupported
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import Dim, numel
from kiln.ops.fp8_linear import BLOCK  # the quantisation block: K step and scale block

OP = "kiln.fp8_linear.default"
_ACTIVATIONS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Fp8Shape:
    """What the kernel computes, read off the region's fp8_linear op."""

    x: str  # operand value names (region inputs or ops)
    weight: str
    scale: str  # weight_scale_inv [ceil(N/128), ceil(K/128)]
    bias: str | None
    out: str  # the region output holding y
    x_shape: tuple  # [..., K]
    out_shape: tuple  # [..., N]
    m: Dim  # tokens: the product of x's leading dims
    n: int
    k: int
    dtype: torch.dtype  # x's (and the output's)

    @property
    def k_blocks(self) -> int:
        return -(-self.k // BLOCK)

    @property
    def n_blocks(self) -> int:
        return -(-self.n // BLOCK)


def _shape(region: Region, plan: DispatchPlan, name: str) -> tuple:
    if name in region.inputs:
        return tuple(plan.values[name].shape)
    return tuple(region.op(name).shape)


def _dtype(region: Region, plan: DispatchPlan, name: str) -> torch.dtype:
    if name in region.inputs:
        return plan.values[name].dtype
    return region.op(name).dtype


def analyse(region: Region, plan: DispatchPlan) -> Fp8Shape:
    """The region's op; raises CodegenUnsupported (why) when the template cannot run it."""
    anchor = region.anchor()
    if anchor.target != OP:
        raise CodegenUnsupported(f"the region's extern op is {anchor.target}, not {OP}")
    args = list(anchor.args) + [None] * (4 - len(anchor.args))
    x, w, scale, bias = args[:4]
    for name, a in (("x", x), ("weight", w), ("weight_scale_inv", scale)):
        if not isinstance(a, Ref):
            raise CodegenUnsupported(f"{name} is not a tensor")
    if bias is not None and not isinstance(bias, Ref):
        raise CodegenUnsupported("a bias that is not a tensor")
    if region.outputs != [anchor.name]:
        raise CodegenUnsupported(f"the region outputs {region.outputs}, not only the op's "
                                 "result")
    if w.name not in region.inputs:
        raise CodegenUnsupported("a weight computed in the region (the kernel reads a stored "
                                 "[N, K] fp8 weight)")
    N, K = _shape(region, plan, w.name)
    if not (isinstance(N, int) and isinstance(K, int)):
        raise CodegenUnsupported("a weight of symbolic shape")
    if _dtype(region, plan, w.name) != torch.float8_e4m3fn:
        raise CodegenUnsupported(f"a weight of dtype {_dtype(region, plan, w.name)}")
    if _dtype(region, plan, scale.name) != torch.float32:
        raise CodegenUnsupported("weight scales that are not float32")
    dtype = _dtype(region, plan, x.name)
    if dtype not in _ACTIVATIONS:
        raise CodegenUnsupported(f"activations of dtype {dtype}")
    x_shape = _shape(region, plan, x.name)
    return Fp8Shape(x.name, w.name, scale.name, bias.name if bias is not None else None,
                    anchor.name, x_shape, tuple(anchor.shape), numel(x_shape[:-1]), N, K,
                    dtype)
