"""What an fp8 region computes, read off its op: kiln::fp8_linear (the one-kernel
form), kiln::fp8_quantize or kiln::fp8_scaled_mm (the split form).

Each `analyse_*` says why its template declines (CodegenUnsupported) for what it
cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.expr.values import CodegenUnsupported
from kiln.codegen.templates.op_operands import operand_dtype as _dtype
from kiln.codegen.templates.op_operands import operand_shape as _shape
from kiln.ir.plan import DispatchPlan, Op, Ref, Region
from kiln.ir.symbolic import Dim, numel, same_dim
from kiln.ops.fp8_linear import BLOCK  # the quantisation block: K step and scale block

OP = "kiln.fp8_linear.default"
QUANTIZE_OP = "kiln.fp8_quantize.default"
SCALED_MM_OP = "kiln.fp8_scaled_mm.default"
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
    stored: str | None = None  # the region's output when residual adds follow the product

    @property
    def k_blocks(self) -> int:
        return -(-self.k // BLOCK)

    @property
    def n_blocks(self) -> int:
        return -(-self.n // BLOCK)


def _anchor(region: Region, op: str):
    anchor = region.anchor()
    if anchor.target != op:
        raise CodegenUnsupported(f"the region's extern op is {anchor.target}, not {op}")
    return anchor


def analyse(region: Region, plan: DispatchPlan) -> Fp8Shape:
    """The region's op; raises CodegenUnsupported (why) when the template cannot run it."""
    anchor = _anchor(region, OP)
    shape = analyse_op(region, plan, anchor)
    if region.outputs != [anchor.name]:
        if len(region.outputs) != 1 or not _residual_epilogue(region, anchor):
            raise CodegenUnsupported(f"the region outputs {region.outputs}, not the op's "
                                     "result or residual adds over it")
        shape.stored = region.outputs[0]
    return shape


_EPILOGUE_OPS = {"aten.add.Tensor", "aten._to_copy.default"}


def _residual_epilogue(region: Region, anchor: Op) -> bool:
    """Are the ops after the product residual adds and casts over its own shape
    (dispatch/grouping.py's fp8 epilogue), the region's output the last of them?"""
    after, names = [], {anchor.name}
    for op in region.ops[region.ops.index(anchor) + 1:]:
        if any(r in names for r in op.refs()):
            after.append(op)
            names.add(op.name)
    out = region.op(region.outputs[0])
    return (bool(after) and all(o.target in _EPILOGUE_OPS for o in after)
            and out in after and len(out.shape) == len(anchor.shape)
            and all(same_dim(a, b) for a, b in zip(out.shape, anchor.shape)))


def analyse_op(region: Region, plan: DispatchPlan, anchor: Op) -> Fp8Shape:
    """One kiln::fp8_linear op of the region (a grouped region holds several)."""
    args = list(anchor.args) + [None] * (4 - len(anchor.args))
    x, w, scale, bias = args[:4]
    for name, a in (("x", x), ("weight", w), ("weight_scale_inv", scale)):
        if not isinstance(a, Ref):
            raise CodegenUnsupported(f"{name} is not a tensor")
    if bias is not None and not isinstance(bias, Ref):
        raise CodegenUnsupported("a bias that is not a tensor")
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


@dataclass
class QuantShape:
    """kiln::fp8_quantize: x [..., K] -> e4m3 values `xq` [..., K], scales `xs` [..., KB]."""

    x: str
    xq: str  # the region outputs holding the tuple's two parts
    xs: str
    x_shape: tuple
    m: Dim  # tokens
    k: int
    dtype: torch.dtype

    @property
    def k_blocks(self) -> int:
        return -(-self.k // BLOCK)


def analyse_quantize(region: Region, plan: DispatchPlan) -> QuantShape:
    """The region's quantisation; raises CodegenUnsupported (why) when it cannot run."""
    anchor = _anchor(region, QUANTIZE_OP)
    x = anchor.args[0]
    if not isinstance(x, Ref):
        raise CodegenUnsupported("x is not a tensor")
    parts = {op.args[1]: op.name for op in region.ops
             if op.target == "getitem" and op.args[0] == Ref(anchor.name)}
    if set(parts) != {0, 1} or sorted(region.outputs) != sorted(parts.values()):
        raise CodegenUnsupported(f"the region outputs {region.outputs}, not both parts of "
                                 "the quantisation")
    x_shape = _shape(region, plan, x.name)
    k, dtype = x_shape[-1], _dtype(region, plan, x.name)
    if not isinstance(k, int):
        raise CodegenUnsupported("a symbolic feature dim")
    if dtype not in _ACTIVATIONS:
        raise CodegenUnsupported(f"activations of dtype {dtype}")
    return QuantShape(x.name, parts[0], parts[1], x_shape, numel(x_shape[:-1]), k, dtype)


@dataclass
class GemmShape:
    """kiln::fp8_scaled_mm: quantised x [..., K] and its scales times the fp8 weight."""

    xq: str  # region inputs, each read in place (contiguous plan values)
    xs: str
    weight: str
    scale: str
    bias: str | None
    out: str
    out_shape: tuple  # [..., N]
    m: Dim
    n: int
    k: int
    dtype: torch.dtype  # the output's

    @property
    def k_blocks(self) -> int:
        return -(-self.k // BLOCK)


def analyse_scaled_mm(region: Region, plan: DispatchPlan) -> GemmShape:
    """The region's GEMM; raises CodegenUnsupported (why) when the template cannot run it."""
    anchor = _anchor(region, SCALED_MM_OP)
    xq, xs, w, scale, bias, out_dtype = (list(anchor.args) + [None] * 6)[:6]
    names = {"xq": xq, "x_scale": xs, "weight": w, "weight_scale_inv": scale}
    if bias is not None:
        names["bias"] = bias
    for name, a in names.items():
        if not isinstance(a, Ref) or a.name not in region.inputs:
            raise CodegenUnsupported(f"{name} is not a stored tensor (the kernel reads "
                                     "each operand in place)")
    if region.outputs != [anchor.name]:
        raise CodegenUnsupported(f"the region outputs {region.outputs}, not only the op's "
                                 "result")
    N, K = _shape(region, plan, w.name)
    if not (isinstance(N, int) and isinstance(K, int)):
        raise CodegenUnsupported("a weight of symbolic shape")
    if out_dtype not in _ACTIVATIONS:
        raise CodegenUnsupported(f"an output of dtype {out_dtype}")
    want = {xq.name: torch.float8_e4m3fn, w.name: torch.float8_e4m3fn,
            xs.name: torch.float32, scale.name: torch.float32}
    for name, dtype in want.items():
        if _dtype(region, plan, name) != dtype:
            raise CodegenUnsupported(f"%{name} has dtype {_dtype(region, plan, name)}, "
                                     f"not {dtype}")
    x_shape = _shape(region, plan, xq.name)
    return GemmShape(xq.name, xs.name, w.name, scale.name, bias.name if bias else None,
                     anchor.name, tuple(anchor.shape), numel(x_shape[:-1]), N, K, out_dtype)
