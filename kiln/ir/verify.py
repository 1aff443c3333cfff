"""IR verifiers: structural checks always, plus the named invariants passes establish.

`verify(ir, invariants)` returns a list of problems (empty = fine). An invariant is
named by the pass that establishes it (see pipeline.Pass.establishes); once
established it is checked after every later pass. A name the verifier does not know
is an error, not a skip: a typo'd invariant would otherwise never be checked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from kiln.errors import VerifierError
from kiln.ir.graph import KilnGraph
from kiln.ir.ops import OpCategory, category, op_name
from kiln.ir.plan import DispatchPlan, RegionKind
from kiln.ir.reshape import is_reshape, round_trips
from kiln.ir.symbolic import as_dim


def verify(ir, invariants: set[str] = frozenset()) -> list[str]:
    check_invariant_names(invariants, where="verify()")
    if isinstance(ir, KilnGraph):
        problems = _graph_structure(ir)
        for name in sorted(invariants):
            problems += GRAPH_INVARIANTS[name](ir)
        return problems
    if isinstance(ir, DispatchPlan):
        return verify_plan(ir)
    own = getattr(ir, "verify", None)
    return own() if own else []


def check_invariant_names(names, where: str) -> None:
    """Raise VerifierError naming every invariant in `names` that the verifier cannot check."""
    unknown = sorted(set(names) - set(GRAPH_INVARIANTS))
    if unknown:
        raise VerifierError(
            f"unknown IR invariant{'s' if len(unknown) > 1 else ''} "
            + ", ".join(repr(n) for n in unknown),
            where=where,
            hint="known invariants: " + ", ".join(sorted(GRAPH_INVARIANTS))
            + "; add a check to kiln/ir/verify.py GRAPH_INVARIANTS for a new one",
        )


# ---- graph ------------------------------------------------------------------------


def _graph_structure(kg: KilnGraph) -> list[str]:
    problems = []
    try:
        kg.graph.lint()
    except Exception as e:  # fx raises RuntimeError with a description
        return [f"malformed FX graph: {e}"]
    placeholders = [n.name for n in kg.graph.nodes if n.op == "placeholder"]
    if placeholders != [i.name for i in kg.inputs]:
        problems.append("placeholders do not match the graph's input specs")
    if len(kg.output_values()) != len(kg.outputs):
        problems.append("outputs do not match the graph's output specs")
    for n in kg.graph.nodes:
        if n.op != "call_function":
            continue
        if "val" not in n.meta:
            problems.append(f"%{n.name} has no meta['val']")
        name = op_name(n.target)
        if category(name) is None and not isinstance(n.meta.get("val"), torch.SymInt):
            problems.append(f"%{n.name} calls {name}, which kiln does not know")
    return problems


def _no_round_trip(kg: KilnGraph) -> list[str]:
    return round_trips(kg.graph)


def _no_reshape_chain(kg: KilnGraph) -> list[str]:
    return [
        f"%{n.name} reshapes the reshape %{n.args[0].name}; chains must be composed"
        for n in kg.graph.nodes
        if is_reshape(n) and is_reshape(n.args[0])
    ]


def _no_dead_code(kg: KilnGraph) -> list[str]:
    return [
        f"%{n.name} ({op_name(n.target)}) is never used"
        for n in kg.graph.nodes
        if n.op == "call_function" and not n.users
    ]


_IDENTITY_VIEW_OPS = ("aten.view.default", "aten.reshape.default", "aten.expand.default",
                      "aten.alias.default")


def _no_identity_views(kg: KilnGraph) -> list[str]:
    out = []
    for n in kg.graph.nodes:
        if n.op == "call_function" and op_name(n.target) in _IDENTITY_VIEW_OPS:
            src = n.args[0]
            if isinstance(src, fx.Node) and _same_val(src, n):
                out.append(f"%{n.name} is an identity {op_name(n.target)}")
    return out


def _same_val(a: fx.Node, b: fx.Node) -> bool:
    """Equal shapes, compared as expressions: comparing torch SymInts with == would add a
    guard to the shape env and could specialise a dynamic dim to its example size."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and [as_dim(d) for d in va.shape] == [as_dim(d) for d in vb.shape])


def _devices_assigned(kg: KilnGraph) -> list[str]:
    return [f"%{n.name} has no device assigned" for n in kg.graph.nodes
            if n.meta.get("device") is None]


GRAPH_INVARIANTS: dict[str, Callable[[KilnGraph], list[str]]] = {
    "no-reshape-round-trip": _no_round_trip,
    "no-reshape-chains": _no_reshape_chain,
    "no-dead-code": _no_dead_code,
    "no-identity-views": _no_identity_views,
    "devices-assigned": _devices_assigned,
}


# ---- plan -------------------------------------------------------------------------

_ANCHORS = {
    RegionKind.MATMUL: OpCategory.MATMUL,
    RegionKind.ATTENTION: OpCategory.ATTENTION,
    RegionKind.REDUCTION: OpCategory.REDUCTION,
    RegionKind.EXTERN: OpCategory.EXTERN,
    RegionKind.TOPK: OpCategory.TOPK,
}


_FP8_LINEAR = "kiln.fp8_linear.default"


def _grouped_fp8(r, anchor: OpCategory) -> bool:
    """An extern region of grouped fp8 sibling GEMVs (dispatch/group_fp8_siblings.py):
    several kiln::fp8_linear ops and no other extern op."""
    extern = [op.target for op in r.ops if category(op.target) == anchor]
    return len(extern) > 1 and set(extern) == {_FP8_LINEAR}


def verify_plan(plan: DispatchPlan) -> list[str]:
    problems = []
    available = {n for n, v in plan.values.items() if v.role.value in ("input", "weight", "state")}
    for r in plan.regions:
        for v in r.inputs:
            if v not in plan.values:
                problems.append(f"region {r.name} reads unknown value %{v}")
            elif v not in available:
                problems.append(f"region {r.name} reads %{v} before it is produced")
        local = set(r.inputs)
        for op in r.ops:
            for ref in op.refs():
                if ref not in local:
                    problems.append(f"region {r.name}: %{op.name} reads %{ref}, not yet defined")
            local.add(op.name)
        for o in r.outputs:
            if o not in local:
                problems.append(f"region {r.name} outputs %{o}, which no op defines")
            if o not in plan.values:
                problems.append(f"region {r.name} output %{o} is not a plan value")
            available.add(o)
        lost = [b for b in r.key_bound_values() if b not in r.inputs]
        if lost:  # the template would walk every key block, silently (mask_envelope.py)
            problems.append(f"region {r.name}'s key bounds {', '.join(lost)} are not among "
                            "its inputs")
        anchor = _ANCHORS.get(r.kind)
        if anchor is not None:
            count = sum(category(op.target) == anchor for op in r.ops)
            single = (RegionKind.ATTENTION, RegionKind.EXTERN, RegionKind.TOPK)
            if r.kind in single and count != 1 and not _grouped_fp8(r, anchor):
                problems.append(f"{r.kind.value} region {r.name} has {count} {anchor.value} ops")
            # sibling GEMVs grouped into one region (dispatch/group_siblings.py) hold several
            if r.kind == RegionKind.MATMUL and count < 1:
                problems.append(f"{r.kind.value} region {r.name} has {count} {anchor.value} ops")
            if r.kind == RegionKind.REDUCTION and count < 1:
                problems.append(f"reduction region {r.name} has no reduction")
    for o in plan.outputs:
        if o not in available:
            problems.append(f"plan output %{o} is never produced")
    return problems
