"""A Program runs a kernel plan: bind sizes, lay out the arena, launch regions in order.

Inputs are checked first (guards), so a bad call fails before any kernel runs and
no state (KV cache) is half-updated.
"""

from __future__ import annotations

import torch

from kiln.codegen.kernel_plan import KernelPlan
from kiln.errors import ArgumentError
from kiln.ir.plan import Role
from kiln.ir.symbolic import evaluate
from kiln.runtime.guards import bind_symbols
from kiln.runtime.memory_plan import Arena, MemoryPlan


class Program:
    def __init__(self, kplan: KernelPlan, mem: MemoryPlan):
        self.kplan = kplan
        self.plan = kplan.plan
        self.mem = mem
        self.device = torch.device(kplan.target.torch_device)
        self.arena = Arena(mem, self.plan, self.device)
        self._build_steps()
        self._weights = {n: v.target for n, v in self.plan.values.items()
                         if v.role in (Role.WEIGHT, Role.STATE)}

    def _build_steps(self) -> None:
        # Per region, decided once: its kernel, the values it reads, and where each
        # output goes (a state tensor written in place, the arena, or a fresh tensor).
        self._steps = [(self.kplan.kernels[r.name], list(r.inputs),
                        [(o, r.inplace.get(o), self.plan.values[o]) for o in r.outputs])
                       for r in self.plan.regions]

    def set_kernel(self, region: str, kernel) -> None:
        """Run `region` with another kernel (e.g. a different config of the same spec)."""
        self.kplan.kernels[region] = kernel
        self._build_steps()

    def bind(self, args, names=None) -> dict[str, int]:
        return bind_symbols(self.plan, args, self.device.type, names)

    def run(self, args: list[torch.Tensor], state: dict[str, torch.Tensor],
            env: dict[str, int] | None = None, arena: Arena | None = None) -> list[torch.Tensor]:
        """Run every region; `arena` overrides the program's own (CUDA graphs own theirs)."""
        return self._run(args, (), state, env, arena)[0]

    def run_stage(self, args: list[torch.Tensor], received: list[torch.Tensor],
                  state: dict[str, torch.Tensor], env: dict[str, int] | None = None,
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One pipeline stage: user inputs and the values received (in `plan.recv` order)
        in, the user outputs (the last stage's only) and the values to send (`plan.send`
        order) out. Sizes bind from the user inputs, which every rank gets."""
        if len(received) != len(self.plan.recv):
            raise ArgumentError(f"this pipeline stage receives {len(self.plan.recv)} values, "
                                f"got {len(received)}",
                                hint="pass the values the earlier stages sent, in plan.recv order")
        return self._run(args, received, state, env, None)

    def _run(self, args, received, state, env, arena):
        if env is None:
            env = self.bind(args)
        values: dict[str, torch.Tensor] = {n: state[t] for n, t in self._weights.items()}
        values.update(zip(self.plan.user_inputs, args))
        values.update(zip((name for name, _ in self.plan.recv), received))
        planned = (arena or self.arena).views(env)
        for kernel, inputs, outputs in self._steps:
            outs = {}
            for o, state_value, v in outputs:
                if state_value is not None:
                    outs[o] = values[state_value]
                elif o in planned:
                    outs[o] = planned[o]
                else:
                    outs[o] = torch.empty([evaluate(d, env) for d in v.shape], dtype=v.dtype,
                                          device=self.device)
            kernel.run({i: values[i] for i in inputs}, outs, env)
            values.update(outs)
        for target, v in self.plan.state_writes.items():
            state[target].copy_(values[v])
        return [values[o] for o in self.plan.outputs], [values[o] for o, _ in self.plan.send]

    def describe(self) -> str:
        lines = [self.kplan.describe().rstrip(), "memory slots:"]
        for i, s in enumerate(self.mem.slots):
            lines.append(f"  slot {i}: " + ", ".join("%" + v for v in s.values))
        return "\n".join(lines) + "\n"

    def verify(self) -> list[str]:
        return self.kplan.verify()
