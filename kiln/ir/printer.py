"""Readable text for every IR: what KILN_DUMP_IR writes and what tests compare against."""

from __future__ import annotations

import torch
import torch.fx as fx

from kiln.ir.graph import KilnGraph
from kiln.ir.ops import op_name
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, Sym
from kiln.ir.symbolic import as_dim, shape_str, to_str

_DTYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64",
}


def dtype_str(dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).replace("torch.", ""))


def type_str(shape, dtype) -> str:
    return f"{dtype_str(dtype)}{shape_str(shape)}"


def print_ir(ir) -> str:
    if isinstance(ir, KilnGraph):
        return print_graph(ir)
    if isinstance(ir, DispatchPlan):
        return print_plan(ir)
    describe = getattr(ir, "describe", None)
    return describe() if describe else str(ir)


# ---- graph ------------------------------------------------------------------------


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        if isinstance(val, torch.SymInt):
            return to_str(as_dim(val))
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return dtype_str(a)
    if isinstance(a, torch.SymInt):
        return to_str(as_dim(a))
    return repr(a)


def _val_type(node: fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return type_str([as_dim(d) for d in val.shape], val.dtype)
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(type_str([as_dim(d) for d in v.shape], v.dtype)
                               for v in val if isinstance(v, torch.Tensor)) + ")"
    if isinstance(val, torch.SymInt):
        return "sym"
    return type(val).__name__


def print_graph(kg: KilnGraph) -> str:
    syms = ", ".join(f"{k} in {v}" for k, v in sorted(kg.symbols.items()))
    lines = [f"graph  symbols: {syms or '(none)'}"]
    kinds = {i.name: i for i in kg.inputs}
    for node in kg.graph.nodes:
        if node.op == "placeholder":
            i = kinds.get(node.name)
            role = f"{i.kind} {i.target}" if i and i.target else (i.kind if i else "input")
            lines.append(f"  %{node.name}: {_val_type(node)} = {role}")
        elif node.op == "call_function":
            args = ", ".join([_arg(a) for a in node.args]
                             + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
            lines.append(f"  %{node.name}: {_val_type(node)} = {op_name(node.target)}({args})")
        elif node.op == "output":
            outs = []
            for spec, val in zip(kg.outputs, node.args[0]):
                tag = "" if spec.kind == "user" else f"{spec.target} <- "
                outs.append(tag + _arg(val))
            lines.append("  return " + ", ".join(outs))
    return "\n".join(lines) + "\n"


# ---- plan -------------------------------------------------------------------------


def _plan_arg(a) -> str:
    if isinstance(a, Ref):
        return f"%{a.name}"
    if isinstance(a, Sym):
        return to_str(a.expr)
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_plan_arg(x) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return dtype_str(a)
    return repr(a)


def print_op(op: Op) -> str:
    args = ", ".join([_plan_arg(a) for a in op.args]
                     + [f"{k}={_plan_arg(v)}" for k, v in op.kwargs.items()])
    ty = type_str(op.shape, op.dtype) if op.shape is not None else "tuple"
    return f"%{op.name}: {ty} = {op.target}({args})"


def print_region(r: Region, indent: str = "  ") -> str:
    head = (f"{indent}region {r.name} {r.kind.value}"
            f"({', '.join('%' + i for i in r.inputs)}) -> {', '.join('%' + o for o in r.outputs)}")
    if r.inplace:
        head += "  in-place: " + ", ".join(f"%{o} into %{s}" for o, s in r.inplace.items())
    if r.label:
        head += f"  pattern: {r.label}"
    lines = [head]
    lines += [f"{indent}  {print_op(op)}" for op in r.ops]
    lines += [f"{indent}  # {n}" for n in r.notes]
    return "\n".join(lines)


def print_plan(plan: DispatchPlan) -> str:
    syms = ", ".join(f"{k} in {v}" for k, v in sorted(plan.symbols.items()))
    lines = [f"plan  symbols: {syms or '(none)'}  devices: {plan.devices}"]
    for v in plan.values.values():
        if v.role.value in ("input", "weight", "state"):
            tgt = f" {v.target}" if v.target else ""
            lines.append(f"  %{v.name}: {type_str(v.shape, v.dtype)} = {v.role.value}{tgt}")
    for r in plan.regions:
        lines.append(print_region(r))
    outs = ", ".join("%" + o for o in plan.outputs)
    writes = ", ".join(f"{s} <- %{v}" for s, v in plan.state_writes.items())
    lines.append(f"  return {outs}" + (f"; state: {writes}" if writes else ""))
    return "\n".join(lines) + "\n"
