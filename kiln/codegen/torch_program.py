"""A plan whose regions all run as torch ops (the CPU target), as one generated Python
function: straight-line ATen calls, no interpreter between them.

On the CPU a small model's call is host work: a few microseconds of Python per op
decide whether kiln keeps up with eager PyTorch (kiln issue 12). TorchKernel binds each
op's arguments once, but still walks a list of steps, a dict of values and an arena
per region; here the whole plan is written out as source once, so a call is what
eager's own code would be at its best: each op called through its fastest entry
point (a Tensor method or torch function where its meaning is the ATen op's, the
op's C++ entry otherwise), values passed in local variables, each freed after its
last use, sizes read from the call's symbols.

Intermediates are allocated by the ops themselves, as in eager (CPU allocation is
cheap; the arena's out= writes cost a copy for every op that has no out= form).
What the runtime promises stays: in-place writes go to the state tensors, outputs
never alias the caller's inputs, weights or state, a bad index names the op's line.
"""

from __future__ import annotations

import itertools
import math
import re

import torch

from kiln.codegen.torch_kernel import (
    CONTIGUOUS_ARGS,
    callable_for,
    entry_point,
    index_error,
    is_bad_index,
)
from kiln.ir.ops import INPLACE_OF, resolve
from kiln.ir.plan import DispatchPlan, Op, Ref, Role, Sym
from kiln.ir.symbolic import python_int_code

# How each op is called, fastest first: a Tensor method (views; positional arguments
# only, at most this many), a torch function generated from the op's own schema (the
# same arguments in the same order, keyword-only ones by name, and it picks this
# overload for them: tests/codegen/test_torch_program.py checks each against the ATen
# op), or else the op's C++ entry point (a microsecond slower: it converts its
# arguments through the JIT schema, more for keyword arguments).
METHODS = {
    "aten.view.default": ("reshape", 2),
    "aten._unsafe_view.default": ("reshape", 2),
    "aten.reshape.default": ("reshape", 2),
    "aten.permute.default": ("permute", 2),
    "aten.expand.default": ("expand", 2),
    "aten.select.int": ("select", 3),
    "aten.squeeze.dims": ("squeeze", 2),
    "aten.squeeze.dim": ("squeeze", 2),
    "aten.squeeze.default": ("squeeze", 1),
    "aten.unsqueeze.default": ("unsqueeze", 2),
    "aten.transpose.int": ("transpose", 3),
    "aten.t.default": ("t", 1),
}
_VF, _NN = torch._C._VariableFunctions, torch._C._nn
FUNCTIONS = {
    "aten.mm.default": _VF.mm,
    "aten.bmm.default": _VF.bmm,
    "aten.addmm.default": _VF.addmm,
    "aten.baddbmm.default": _VF.baddbmm,
    "aten.add.Tensor": _VF.add,
    "aten.sub.Tensor": _VF.sub,
    "aten.mul.Tensor": _VF.mul,
    "aten.div.Tensor": _VF.div,
    "aten.pow.Tensor_Scalar": _VF.pow,
    "aten.neg.default": _VF.neg,
    "aten.relu.default": _VF.relu,
    "aten.sigmoid.default": _VF.sigmoid,
    "aten.tanh.default": _VF.tanh,
    "aten.exp.default": _VF.exp,
    "aten.rsqrt.default": _VF.rsqrt,
    "aten.sqrt.default": _VF.sqrt,
    "aten.cos.default": _VF.cos,
    "aten.sin.default": _VF.sin,
    "aten.gelu.default": _NN.gelu,
    "aten.silu.default": _NN.silu,
    "aten.clone.default": _VF.clone,
    "aten.where.self": _VF.where,
    "aten.eq.Tensor": _VF.eq,
    "aten.eq.Scalar": _VF.eq,
    "aten.ne.Scalar": _VF.ne,
    "aten.le.Tensor": _VF.le,
    "aten.ge.Scalar": _VF.ge,
    "aten.bitwise_and.Tensor": _VF.bitwise_and,
    "aten.mean.dim": _VF.mean,
    "aten.sum.dim_IntList": _VF.sum,
    "aten.amax.default": _VF.amax,
    "aten.cumsum.default": _VF.cumsum,
    "aten._softmax.default": _VF._softmax,
    "aten.cat.default": _VF.cat,
    "aten.full.default": _VF.full,
    "aten.arange.start_step": _VF.arange,
    "aten.embedding.default": _VF.embedding,
    "aten.native_layer_norm.default": _VF.native_layer_norm,
    "aten.scaled_dot_product_attention.default": _NN.scaled_dot_product_attention,
    "aten.convolution.default": _VF.convolution,
    "aten.max_pool2d_with_indices.default": _NN.max_pool2d_with_indices,
    "aten.lstm.input": _VF.lstm,
    "aten.gru.input": _VF.gru,
}
_SCALAR_TYPES = (bool, int, str, type(None))
_NAME = re.compile(r"[^0-9a-zA-Z_]")
_counter = itertools.count()


def _aliases_input(target: str) -> bool:
    """Whether the op's result may be a view of its first argument (its schema says so)."""
    if target == "getitem":
        return True  # an element of a tuple: a view where the tuple's op made views
    op = resolve(target)
    return any(r.alias_info is not None for r in op._schema.returns)


class _Writer:
    """Names, constants and lines of the generated function."""

    def __init__(self, device: torch.device):
        self.device = device
        self.names: dict[str, str] = {}
        self.consts: dict[str, object] = {"torch": torch}
        self._const_names: dict[int, str] = {}  # id -> name, for callables used again
        self.lines: list[str] = []
        self.line_ops: dict[int, Op] = {}  # source line number -> the op it runs

    def var(self, value: str) -> str:
        if value not in self.names:
            self.names[value] = f"v_{_NAME.sub('_', value)}_{len(self.names)}"
        return self.names[value]

    def const(self, value) -> str:
        name = self._const_names.get(id(value)) if callable(value) else None
        if name is None:
            name = f"c{len(self.consts)}"
            self.consts[name] = value
            self._const_names[id(value)] = name
        return name

    def arg(self, a) -> str:
        """An argument as source: a value's variable, a size's expression, a literal."""
        if isinstance(a, Ref):
            return self.var(a.name)
        if isinstance(a, Sym):
            return str(a.expr) if isinstance(a.expr, int) else python_int_code(a.expr)
        if isinstance(a, torch.device):
            return self.const(self.device)
        if isinstance(a, list | tuple):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, _SCALAR_TYPES) or (isinstance(a, float) and math.isfinite(a)):
            return repr(a)
        return self.const(a)

    def emit(self, line: str, op: Op | None = None) -> None:
        self.lines.append(line)
        if op is not None:
            self.line_ops[len(self.lines) + 1] = op  # +1: the def line comes first


def _call(w: _Writer, op: Op) -> str:
    """The op's call as source (its result: a tensor or a tuple)."""
    if op.target == "getitem":
        return f"{w.arg(op.args[0])}[{w.arg(op.args[1])}]"
    args = [w.arg(a) for a in op.args]
    for j in CONTIGUOUS_ARGS.get(op.target, ()):
        args[j] = f"{args[j]}.contiguous()"
    method = METHODS.get(op.target)
    if method is not None and not op.kwargs and len(args) <= method[1]:
        return f"{args[0]}.{method[0]}({', '.join(args[1:])})"
    fn = FUNCTIONS.get(op.target) or entry_point(callable_for(op.target))
    kwargs = [f"{k}={w.arg(v)}" for k, v in op.kwargs.items()]
    return f"{w.const(fn)}({', '.join(args + kwargs)})"


class TorchProgram:
    """The plan's regions as one function (outputs, written state) <- (inputs, weights,
    sizes). Build it only where every region runs as torch ops."""

    def __init__(self, plan: DispatchPlan, device: torch.device):
        self.plan = plan
        self.device = torch.device(device)
        w = _Writer(self.device)
        self.weight_names = [n for n, v in plan.values.items()
                             if v.role in (Role.WEIGHT, Role.STATE)]
        for i, n in enumerate(plan.user_inputs):
            w.emit(f"{w.var(n)} = inputs[{i}]")
        for i, n in enumerate(self.weight_names):
            w.emit(f"{w.var(n)} = weights[{i}]")
        held = set(plan.user_inputs) | set(self.weight_names)  # the caller's tensors
        may_alias = set(held)  # values that may be views of them
        last = self._last_uses()
        keep = held | set(plan.outputs) | set(plan.state_writes.values())
        live: dict[str, Op] = {}  # pure ops whose value is held: a region's copy reuses it
        for step, (region, op) in enumerate(self._ops()):
            if live.get(op.name) == op and op.name not in region.inplace:
                pass  # a cheap op region formation repeated in each region that reads it
            elif op.name in region.inplace and op.target not in INPLACE_OF:
                # a one-element state recomputed whole (dispatch/reinplace.py)
                dest = w.var(region.inplace[op.name])
                w.emit(f"{dest}.copy_({_call(w, op)})", op)
                w.emit(f"{w.var(op.name)} = {dest}")
                may_alias.add(op.name)
            elif op.name in region.inplace:
                dest = w.var(region.inplace[op.name])
                fn = w.const(entry_point(resolve(INPLACE_OF[op.target])))
                rest = [w.arg(a) for a in op.args[1:]]
                rest += [f"{k}={w.arg(v)}" for k, v in op.kwargs.items()]
                w.emit(f"{fn}({', '.join([dest] + rest)})", op)
                w.emit(f"{w.var(op.name)} = {dest}")
                may_alias.add(op.name)
            else:
                w.emit(f"{w.var(op.name)} = {_call(w, op)}", op)
                live[op.name] = op
                if op.args and isinstance(op.args[0], Ref) and op.args[0].name in may_alias \
                        and _aliases_input(op.target):
                    may_alias.add(op.name)
            dead = [w.var(n) for n in last.get(step, ()) if n not in keep]
            for n in last.get(step, ()):
                live.pop(n, None)
            if dead:
                w.emit(f"del {', '.join(dead)}")
        for target, v in plan.state_writes.items():
            w.emit(f"state[{target!r}].copy_({w.var(v)})")
        outs = []
        for o in plan.outputs:  # a fresh tensor, never one the caller holds
            fresh = o not in may_alias and outs.count(w.var(o)) == 0
            outs.append(w.var(o) if fresh else
                        f"{w.var(o)}.clone(memory_format=torch.contiguous_format)")
        w.emit(f"return [{', '.join(outs)}]")
        self.filename = f"<kiln torch program {next(_counter)}>"
        self.source = "def run(inputs, weights, state, env):\n" + "".join(
            f"    {line}\n" for line in w.lines)
        scope = dict(w.consts)
        exec(compile(self.source, self.filename, "exec"), scope)  # noqa: S102
        self._fn = scope["run"]
        self._line_ops = w.line_ops

    def _ops(self):
        for region in self.plan.regions:
            for op in region.ops:
                yield region, op

    def _last_uses(self) -> dict[int, list[str]]:
        """Per step, the values read for the last time there (freed after it)."""
        last: dict[str, int] = {}
        for step, (_, op) in enumerate(self._ops()):
            for n in op.refs():
                last[n] = step
            last.setdefault(op.name, step)  # never read: freed at once
        by_step: dict[int, list[str]] = {}
        for n, step in last.items():
            by_step.setdefault(step, []).append(n)
        return by_step

    def __call__(self, inputs, weights, state, env) -> list[torch.Tensor]:
        try:
            return self._fn(inputs, weights, state, env)
        except (IndexError, RuntimeError) as e:  # the user's data, or a kiln bug
            if not is_bad_index(e):
                raise
            op = self._failing_op(e)
            if op is None:
                raise
            raise index_error(op, e) from e

    def _failing_op(self, e: BaseException) -> Op | None:
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.filename:
                return self._line_ops.get(tb.tb_lineno)
            tb = tb.tb_next
        return None
