"""A region run op by op through PyTorch: the CPU target's kernels and the extern path.

Each op is the same ATen call the graph holds, so results match eager PyTorch.
Outputs are written into the buffers the memory planner assigned: directly through
the op's `out=` overload where ATen has one, else by a copy. In kiln's value
semantics a `view` is a logical reshape, so it runs as `reshape` (our producers'
layouts need not match eager's strides).
"""

from __future__ import annotations

import functools

import torch

from kiln.ir.ops import INPLACE_OF, STRICT_VIEWS, resolve
from kiln.ir.plan import Op, Ref, Region, Sym
from kiln.ir.printer import print_region
from kiln.ir.symbolic import evaluate


@functools.cache
def out_overload(name: str):
    """The `out=` overload with the same arguments (names and types) as `name`, if any."""
    if name == "getitem":
        return None
    ns, op, overload = name.split(".")
    packet = getattr(getattr(torch.ops, ns), op)
    want = [(a.name, str(a.type)) for a in getattr(packet, overload)._schema.arguments]
    for o in packet.overloads():
        schema = getattr(packet, o)._schema
        outs = [a for a in schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
        if len(outs) == 1 and outs[0].name == "out" and rest == want:
            return getattr(packet, o)
    return None


@functools.cache
def callable_for(name: str):
    return resolve("aten.reshape.default" if name in STRICT_VIEWS else name)


class TorchKernel:
    """Runs `region` with torch ops on whatever device its tensors live on."""

    kind = "torch"

    def __init__(self, region: Region, device: str | torch.device = "cpu"):
        self.region = region
        self.device = torch.device(device)
        self._fns = [callable_for(op.target) for op in region.ops]
        self._outs = {o: out_overload(region.op(o).target) for o in region.outputs
                      if o not in region.inplace}

    def _arg(self, a, local, env):
        if isinstance(a, Ref):
            return local[a.name]
        if isinstance(a, Sym):
            return evaluate(a.expr, env)
        if isinstance(a, torch.device):
            return self.device
        if isinstance(a, list):
            return [self._arg(x, local, env) for x in a]
        if isinstance(a, tuple):
            return tuple(self._arg(x, local, env) for x in a)
        return a

    def _call(self, i: int, op: Op, local, env, outs):
        args = [self._arg(a, local, env) for a in op.args]
        kwargs = {k: self._arg(v, local, env) for k, v in op.kwargs.items()}
        if op.name in self.region.inplace:
            dest = outs[op.name]
            resolve(INPLACE_OF[op.target])(dest, *args[1:], **kwargs)
            return dest
        out_fn = self._outs.get(op.name)
        if out_fn is not None and op.name in outs:
            out_fn(*args, **kwargs, out=outs[op.name])
            return outs[op.name]
        return self._fns[i](*args, **kwargs)

    def run(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
            env: dict[str, int]) -> None:
        local = dict(inputs)
        for i, op in enumerate(self.region.ops):
            local[op.name] = self._call(i, op, local, env, outs)
        for o in self.region.outputs:
            if local[o] is not outs[o]:
                outs[o].copy_(local[o])

    def describe(self) -> str:
        return f"torch ops on {self.device.type}:\n" + print_region(self.region, "  ")

    def to_json(self) -> dict:
        return {"kind": self.kind}
