"""Quantise an fp8 linear's activations once: kiln::fp8_linear over many tokens becomes
kiln::fp8_quantize followed by kiln::fp8_scaled_mm (kiln.ops.fp8_linear).

One kernel for the whole op must quantise each [tokens, 128] tile of x inside its K
loop, once for every output tile that reads it (N / BLOCK_N times), and that work sits
in the loop beside the tensor-core product, where it keeps the loads of the operands
from being pipelined (about 0.3x torch._scaled_mm at 2048 tokens on an H100). Split,
x is quantised once into an fp8 copy with its scales, and the GEMM's K loop is the
standard block-scaled one: two fp8 tiles and a scale pair per 128-wide step.

Up to DECODE_TOKENS tokens (a decode step) the op stays whole: the x tile is a few
rows, requantising it costs little beside streaming the weight, and a second kernel
launch per linear would cost more. A token count with no upper bound is split.
The two ops compose to fp8_linear exactly (the op's own definition), so the split
changes no result on any target.
"""

from __future__ import annotations

import operator

import torch

from kiln.graph.rewrite import insert, is_op
from kiln.ir.graph import KilnGraph, shape_of
from kiln.ir.symbolic import bounds_of, numel
from kiln.pipeline import as_pass

OP = "kiln.fp8_linear.default"
DECODE_TOKENS = 64  # at most this many tokens: one kernel quantises in its K loop


def is_decode(tokens, symbols) -> bool:
    """Can the linear's token count be at most DECODE_TOKENS only?"""
    hi = bounds_of(tokens, symbols).hi
    return hi is not None and hi <= DECODE_TOKENS


def split_fp8_linears(kg: KilnGraph) -> int:
    """Rewrite every fp8 linear over more than DECODE_TOKENS tokens; returns how many."""
    count = 0
    for node in list(kg.graph.nodes):
        if not is_op(node, OP):
            continue
        x, weight, scale, bias = (list(node.args) + [None] * 4)[:4]
        if is_decode(numel(shape_of(x)[:-1]), kg.symbols):
            continue
        quant = insert(kg, node, torch.ops.kiln.fp8_quantize.default, (x,), like=node)
        xq = insert(kg, node, operator.getitem, (quant, 0), like=node)
        xs = insert(kg, node, operator.getitem, (quant, 1), like=node)
        mm = insert(kg, node, torch.ops.kiln.fp8_scaled_mm.default,
                    (xq, xs, weight, scale, bias, node.meta["val"].dtype), like=node)
        node.replace_all_uses_with(mm)
        kg.graph.erase_node(node)
        count += 1
    return count


@as_pass
def split_fp8_linear(kg: KilnGraph, ctx) -> KilnGraph:
    if split_fp8_linears(kg):
        kg.recompile()
    return kg
