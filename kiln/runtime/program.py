"""A Program runs a kernel plan: bind sizes, lay out the arena, launch regions in order.

Inputs are checked first (guards), so a bad call fails before any kernel runs and
no state (KV cache) is half-updated.

A prefill's kernels are small enough that host work per launch decides its speed
(kiln issue 10), so everything that depends only on the call's sizes (the arena's
views, each kernel's size arguments, grid and scratch, fresh outputs' shapes) is
worked out once per set of sizes and kept (`_Bound`, for the KEPT_SIZES sets used
last); a call at sizes seen before only checks its arguments, looks up the tensors that
change per call (inputs, weights, state) and launches. Growing the arena drops every
kept set, since their views point into the old storage.

A program may carry a narrow version (`narrow`): the same model's plan compiled again
for the sizes where one dim keeps its products in their GEMV form
(dispatch/narrow_rows.py: one row of a decode batch). Its caller runs `for_sizes(env)`,
which is that version at those sizes and the program itself otherwise; both read the
same weights and state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.codegen.build.launcher import current_stream
from kiln.codegen.build.triton_kernel import BoundLaunch
from kiln.codegen.kernel_plan import KernelPlan
from kiln.codegen.torch_program import TorchProgram
from kiln.errors import ArgumentError
from kiln.ir.plan import Role
from kiln.ir.symbolic import evaluate
from kiln.runtime.guards import FastBinder, bind_symbols
from kiln.runtime.memory_plan import Arena, MemoryPlan


class _Bound:
    """A Program's run at one set of sizes: the arena's views (in `storage`) and per
    region its bound launch, its outputs that alias state tensors, and the shapes of
    those allocated fresh on every call."""

    __slots__ = ("storage", "planned", "steps")

    def __init__(self, storage, planned: dict[str, torch.Tensor], steps: list):
        self.storage = storage
        self.planned = planned
        self.steps = steps


@dataclass(frozen=True)
class NarrowVersion:
    """`program` runs the calls whose size `symbol` is at most `hi`."""

    symbol: str
    hi: int
    program: Program


class Program:
    KEPT_SIZES = 16  # sets of sizes whose bound launches are kept

    def __init__(self, kplan: KernelPlan, mem: MemoryPlan):
        self.kplan = kplan
        self.plan = kplan.plan
        self.mem = mem
        self.device = torch.device(kplan.target.torch_device)
        self.arena = Arena(mem, self.plan, self.device)
        self._fast_bind = FastBinder(self.plan, self.device.type)
        self._bound: dict[tuple, _Bound] = {}
        self._build_steps()
        weights = [(n, v.target) for n, v in self.plan.values.items()
                   if v.role in (Role.WEIGHT, Role.STATE)]
        self._weight_names = [n for n, _ in weights]
        self._weight_targets = [t for _, t in weights]
        self.narrow: NarrowVersion | None = None

    def versions(self) -> tuple[Program, ...]:
        """This program and its narrow version, if any: every plan the module may run."""
        return (self,) if self.narrow is None else (self, self.narrow.program)

    def for_sizes(self, env: dict[str, int]) -> Program:
        """The program for a call bound at `env`: the narrow version where it applies."""
        n = self.narrow
        if n is not None and env.get(n.symbol, n.hi + 1) <= n.hi:
            return n.program
        return self

    def _build_steps(self) -> None:
        # Per region, decided once: its kernel and where each output goes (a state
        # tensor written in place, the arena, or a fresh tensor).
        self._whole = self._torch_program()
        self._steps = [(self.kplan.kernels[r.name],
                        [(o, r.inplace.get(o), self.plan.values[o]) for o in r.outputs])
                       for r in self.plan.regions]
        self._bound.clear()

    def _torch_program(self) -> TorchProgram | None:
        """On the CPU target, the whole plan as one generated function (no arena, no
        per-region launches): every region runs as torch ops there."""
        if self.kplan.target.name != "cpu" or self.plan.recv or self.plan.send:
            return None
        if any(self.kplan.kernels[r.name].kind != "torch" for r in self.plan.regions):
            return None
        return TorchProgram(self.plan, self.device)

    def set_kernel(self, region: str, kernel) -> None:
        """Run `region` with another kernel (e.g. a different config of the same spec)."""
        self.kplan.kernels[region] = kernel
        self._build_steps()

    def bind(self, args, names=None, sizes=()) -> dict[str, int]:
        """The call's size symbols from its tensors' dims and its int size arguments."""
        env = self._fast_bind(args, sizes)
        return env if env is not None else bind_symbols(self.plan, args, self.device.type,
                                                        names, sizes)

    def run(self, args: list[torch.Tensor], state: dict[str, torch.Tensor],
            env: dict[str, int] | None = None, arena: Arena | None = None) -> list[torch.Tensor]:
        """Run every region; `arena` overrides the program's own (CUDA graphs own theirs)."""
        if self._whole is not None and arena is None:
            if env is None:
                env = self.bind(args)
            return self._whole(args, list(map(state.__getitem__, self._weight_targets)),
                               state, env)
        return self._run(args, (), state, env, arena)[0]

    def run_stage(self, args: list[torch.Tensor], received: list[torch.Tensor],
                  state: dict[str, torch.Tensor], env: dict[str, int] | None = None,
                  arena: Arena | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One pipeline stage: user inputs and the values received (in `plan.recv` order)
        in, the user outputs (the last stage's only) and the values to send (`plan.send`
        order) out. Sizes bind from the user inputs, which every rank gets. `arena` as
        in `run`."""
        if len(received) != len(self.plan.recv):
            raise ArgumentError(f"this pipeline stage receives {len(self.plan.recv)} values, "
                                f"got {len(received)}",
                                hint="pass the values the earlier stages sent, in plan.recv order")
        return self._run(args, received, state, env, arena)

    def _bind_sizes(self, env: dict[str, int], arena: Arena) -> _Bound:
        planned = arena.views(env)
        steps = []
        for kernel, outputs in self._steps:
            aliases = [(o, state_value) for o, state_value, _ in outputs
                       if state_value is not None]
            fresh = [(o, [evaluate(d, env) for d in v.shape], v.dtype)
                     for o, state_value, v in outputs
                     if state_value is None and o not in planned]
            steps.append((kernel.bind(env, planned, self.device), aliases, fresh))
        follows_kernel(steps)
        return _Bound(arena.storage, planned, steps)

    def _bound_for(self, env: dict[str, int], arena: Arena | None) -> _Bound:
        """The run bound at these sizes: kept for the program's own arena, made afresh
        for another (a CUDA graph's, which runs only while being captured)."""
        if arena is not None and arena is not self.arena:
            return self._bind_sizes(env, arena)
        key = tuple(sorted(env.items()))
        bound = self._bound.pop(key, None)
        if bound is None or bound.storage is not self.arena.storage:
            bound = self._bind_sizes(env, self.arena)
            if any(b.storage is not bound.storage for b in self._bound.values()):
                self._bound.clear()  # the arena grew: the others' views are stale
            elif len(self._bound) >= self.KEPT_SIZES:
                del self._bound[next(iter(self._bound))]
        self._bound[key] = bound  # most recently used last
        return bound

    def _run(self, args, received, state, env, arena):
        if env is None:
            env = self.bind(args)
        bound = self._bound_for(env, arena)
        values: dict[str, torch.Tensor] = dict(zip(
            self._weight_names, map(state.__getitem__, self._weight_targets)))
        values.update(bound.planned)
        values.update(zip(self.plan.user_inputs, args))
        values.update(zip((name for name, _ in self.plan.recv), received))
        stream, device = current_stream(self.device), self.device
        for launch, aliases, fresh in bound.steps:
            for o, state_value in aliases:
                values[o] = values[state_value]
            for o, shape, dtype in fresh:
                values[o] = torch.empty(shape, dtype=dtype, device=device)
            launch(values, stream)
        for target, v in self.plan.state_writes.items():
            state[target].copy_(values[v])
        return [values[o] for o in self.plan.outputs], [values[o] for o, _ in self.plan.send]

    def describe(self) -> str:
        lines = [self.kplan.describe().rstrip(), "memory slots:"]
        for i, s in enumerate(self.mem.slots):
            lines.append(f"  slot {i}: " + ", ".join("%" + v for v in s.values))
        if self.narrow is not None:
            lines.append(f"narrow version, for {self.narrow.symbol} <= {self.narrow.hi}:")
            lines.append(self.narrow.program.describe().rstrip())
        return "\n".join(lines) + "\n"

    def verify(self) -> list[str]:
        return self.kplan.verify() + (self.narrow.program.verify()
                                      if self.narrow is not None else [])


def follows_kernel(steps: list) -> None:
    """Mark each Triton launch that comes right after another Triton kernel's launch as
    a programmatic dependent (build/grid_dependency.py): only then is the work just
    before it in the stream a kiln kernel, which waits for its own predecessor. The
    first launch of a call (after the caller's copies) and one after a torch region
    launch the ordinary way."""
    before = None
    for bound, _, _ in steps:
        if isinstance(bound, BoundLaunch):
            bound.dependent = isinstance(before, BoundLaunch) and before.launch is not None
        before = bound
