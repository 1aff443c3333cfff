"""A region's cost as symbolic expressions: bytes it moves and flops it computes.

An analysis for reports (`kiln explain`), not a pass. Costs are roofline-style
first-order estimates, kept symbolic in the plan's size symbols so they can be
evaluated at any size (the example's, the upper bounds):

- bytes read: each region input once at its own size (a broadcast input is read at
  its stored size, weights fully) -- except a table read only through gathers
  (embedding rows, `cos[input_pos]`), which reads just the gathered elements, and
  the destination of an in-place write, which is not read at all;
- bytes written: each output, except that an in-place scatter (a KV-cache update)
  writes only the elements it scatters;
- flops: matmul 2·M·N·K (per batch), attention 2·B·H·Tq·Tk·(D + Dv) ≈ 4·B·H·Tq·Tk·D,
  pointwise ops one per output element, reductions a few per input element, topk k
  per input element (a comparison per element and pick, as kiln's kernel); casts,
  copies, views, gathers and scatters move data and compute nothing;
- kiln's own ops (kiln.ops) by what they compute: fp8 linear and scaled mm 2·M·N·K;
  the routed experts 6·N·k·I·D (gate, up, down for each of a token's k experts);
  latent attention 2·B·T·H·S·(2R + P) over every key the cache can hold (the kernel
  stops at each row's position: an upper bound); the gated delta rule 6·B·T·HV·K·V
  (its recurrence: decay, update and read of a K x V state per token and value head).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from kiln.ir.ops import IDENTITY_OPS, OpCategory, bind_args, category
from kiln.ir.plan import DispatchPlan, Op, Ref, Region
from kiln.ir.symbolic import Dim, numel

# Ops of category POINTWISE that only move or convert data.
_DATA_ONLY = IDENTITY_OPS | {"aten._to_copy.default", "aten.copy.default"}

# Flops per reduced input element (a max, a subtract, an exp, a sum, a divide, ...).
_REDUCTION_FLOPS = {
    "aten.var.correction": 3, "aten.var.dim": 3, "aten.var_mean.correction": 3,
    "aten._softmax.default": 5, "aten._log_softmax.default": 5,
    "aten.native_layer_norm.default": 8, "aten.logsumexp.default": 4,
}

_GATHER_TABLE_ARG = 0  # embedding(weight, idx), index(self, idx), gather(self, dim, idx)


@dataclass(frozen=True)
class Cost:
    read: Dim  # bytes
    written: Dim  # bytes
    flops: Dim

    @property
    def bytes(self) -> Dim:
        return self.read + self.written

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.read + other.read, self.written + other.written,
                    self.flops + other.flops)


ZERO = Cost(0, 0, 0)


class _Shapes:
    """Shapes and element sizes of everything a region's ops refer to."""

    def __init__(self, region: Region, plan: DispatchPlan):
        self.shape = {n: plan.values[n].shape for n in region.inputs}
        self.itemsize = {n: plan.values[n].itemsize for n in region.inputs}
        for op in region.ops:
            if op.shape is not None:
                self.shape[op.name] = op.shape

    def of(self, a) -> tuple[Dim, ...] | None:
        return self.shape.get(a.name) if isinstance(a, Ref) else None

    def numel(self, a) -> Dim:
        shape = self.of(a)
        return 0 if shape is None else numel(shape)


def _uses(region: Region) -> dict[str, list[tuple[Op, int]]]:
    """For each name, the (op, argument position) pairs that read it directly."""
    uses: dict[str, list[tuple[Op, int]]] = {}
    for op in region.ops:
        for pos, a in enumerate(op.args):
            for ref in _refs(a):
                uses.setdefault(ref, []).append((op, pos))
        for v in op.kwargs.values():
            for ref in _refs(v):
                uses.setdefault(ref, []).append((op, -1))
    return uses


def _refs(a) -> list[str]:
    if isinstance(a, Ref):
        return [a.name]
    if isinstance(a, (list, tuple)):
        return [r for x in a for r in _refs(x)]
    return []


def _bytes_read(region: Region, plan: DispatchPlan, shapes: _Shapes) -> Dim:
    uses = _uses(region)
    inplace_ops = {region.op(o).name for o in region.inplace}
    total: Dim = 0
    for name in region.inputs:
        v = plan.values[name]
        used = uses.get(name, [])
        if used and all(op.name in inplace_ops and pos == 0 and not uses.get(op.name)
                        for op, pos in used):
            continue  # only written in place, not read back: the destination is not read
        if used and all(category(op.target) == OpCategory.GATHER and pos == _GATHER_TABLE_ARG
                        for op, pos in used):
            total += sum(numel(op.shape) for op, _ in used) * v.itemsize
            continue
        total += v.numel * v.itemsize
    return total


def _scattered(op: Op, shapes: _Shapes) -> Dim:
    """Elements an in-place scatter writes (not the whole destination)."""
    if op.target in ("aten.index_copy.default", "aten.index_add.default"):
        return shapes.numel(bind_args(op)["source"])  # the source rows
    if op.target.startswith(("aten.scatter.", "aten.scatter_add.")):
        return shapes.numel(bind_args(op)["index"])  # one write per index element
    if op.target == "aten.index_put.default":
        a = bind_args(op)
        index = [shapes.numel(i) for i in a["indices"] if isinstance(i, Ref)]
        return _max([shapes.numel(a["values"]), *index])
    return numel(op.shape)  # copy_ and anything else: the whole destination


def _max(xs: list[Dim]) -> Dim:
    if all(isinstance(x, int) for x in xs):
        return max(xs)
    return sympy.Max(*xs)


def _bytes_written(region: Region, plan: DispatchPlan, shapes: _Shapes) -> Dim:
    total: Dim = 0
    for o in region.outputs:
        v = plan.values[o]
        if o in region.inplace:
            total += _scattered(region.op(o), shapes) * v.itemsize
        else:
            total += v.numel * v.itemsize
    return total


def _fp8_matmul_flops(op: Op, shapes: _Shapes, weight_arg: int) -> Dim:
    x, w = shapes.of(op.args[0]), shapes.of(op.args[weight_arg])
    return 0 if x is None or w is None else 2 * numel(x[:-1]) * w[0] * w[1]


def _moe_flops(op: Op, shapes: _Shapes) -> Dim:
    x, ids, gate = (shapes.of(op.args[i]) for i in (0, 2, 3))
    if x is None or ids is None or gate is None:
        return 0
    return 6 * x[0] * ids[-1] * gate[1] * gate[2]


def _latent_flops(op: Op, shapes: _Shapes) -> Dim:
    q, qr, kv = (shapes.of(op.args[i]) for i in (0, 1, 2))
    table = shapes.of(op.args[6]) if len(op.args) > 6 else None
    if q is None or qr is None or kv is None:
        return 0
    keys = table[1] * kv[1] if table is not None else kv[-2]
    return 2 * numel(q[:-1]) * keys * (2 * q[-1] + qr[-1])


def _delta_flops(op: Op, shapes: _Shapes) -> Dim:
    q, v = shapes.of(op.args[0]), shapes.of(op.args[2])
    return 0 if q is None or v is None else 6 * numel(v[:-1]) * q[-1] * v[-1]


_KILN_OP_FLOPS = {
    "kiln.fp8_linear.default": lambda op, s: _fp8_matmul_flops(op, s, 1),
    "kiln.fp8_scaled_mm.default": lambda op, s: _fp8_matmul_flops(op, s, 2),
    "kiln.fp8_quantize.default": lambda op, s: s.numel(op.args[0]),
    "kiln.moe_experts.default": _moe_flops,
    "kiln.moe_experts_fp8.default": _moe_flops,  # gate is argument 3 in both
    "kiln.latent_attention.default": _latent_flops,
    "kiln.gated_delta_rule.default": _delta_flops,
}


def op_flops(op: Op, shapes: _Shapes) -> Dim:
    if op.target in _KILN_OP_FLOPS:
        return _KILN_OP_FLOPS[op.target](op, shapes)
    cat = category(op.target)
    if cat == OpCategory.MATMUL:
        return _matmul_flops(op, shapes)
    if cat == OpCategory.ATTENTION:
        q, k, v = (shapes.of(a) for a in op.args[:3])
        if q is None or k is None or v is None:
            return 0
        return 2 * numel(q[:-2]) * q[-2] * k[-2] * (q[-1] + v[-1])
    if cat == OpCategory.POINTWISE:
        return 0 if op.target in _DATA_ONLY or op.shape is None else numel(op.shape)
    if cat == OpCategory.REDUCTION:
        return _REDUCTION_FLOPS.get(op.target, 1) * shapes.numel(op.args[0])
    if cat == OpCategory.TOPK:  # a comparison per element and pick (kiln's kernel)
        k = bind_args(op)["k"]
        return k * shapes.numel(op.args[0]) if isinstance(k, int) else 0
    return 0


def _matmul_flops(op: Op, shapes: _Shapes) -> Dim:
    if op.target == "aten.addmm.default":
        a, b = shapes.of(op.args[1]), shapes.of(op.args[2])
        extra = numel(op.shape)  # the bias add
    else:
        a, b = shapes.of(op.args[0]), shapes.of(op.args[1])
        extra = 0
    if a is None or b is None:
        return 0
    # [..., M, K] @ [..., K, N]: 2·M·N·K multiply-adds per batch element.
    return 2 * numel(op.shape) * a[-1] + extra


def region_cost(region: Region, plan: DispatchPlan) -> Cost:
    shapes = _Shapes(region, plan)
    flops: Dim = 0
    for op in region.ops:
        flops += op_flops(op, shapes)
    return Cost(_bytes_read(region, plan, shapes), _bytes_written(region, plan, shapes), flops)


def plan_costs(plan: DispatchPlan) -> dict[str, Cost]:
    return {r.name: region_cost(r, plan) for r in plan.regions}
