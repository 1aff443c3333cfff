"""The codegen stage's IR: the dispatch plan plus one kernel per region."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.printer import print_plan
from kiln.ir.verify import verify_plan
from kiln.target import Target


class Kernel(Protocol):
    """Runs one region: reads `inputs`, writes each output into its buffer in `outs`.

    `bind` is the runtime's fast path: the region's launch at the sizes `env`, with what
    depends only on them worked out once; `fixed` values (the arena's views: dense,
    aligned, the same tensors on every call at these sizes) may be bound in too. The
    result is called as `launch(values, stream)` with every value by name, the outputs'
    buffers among them.
    """

    kind: str
    region: Region

    def run(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
            env: dict[str, int]) -> None: ...

    def bind(self, env: dict[str, int], fixed: dict[str, torch.Tensor],
             device: torch.device) -> Callable[[dict[str, torch.Tensor], int], None]: ...

    def describe(self) -> str: ...

    def to_json(self) -> dict: ...


@dataclass
class KernelPlan:
    plan: DispatchPlan
    target: Target
    kernels: dict[str, Kernel] = field(default_factory=dict)  # region name -> kernel

    def describe(self) -> str:
        lines = [print_plan(self.plan).rstrip(), f"kernels for {self.target}:"]
        for r in self.plan.regions:
            k = self.kernels.get(r.name)
            lines.append(f"  {r.name}: {k.kind if k else 'MISSING'}")
        return "\n".join(lines) + "\n"

    def verify(self) -> list[str]:
        missing = [r.name for r in self.plan.regions if r.name not in self.kernels]
        return verify_plan(self.plan) + [f"region {m} has no kernel" for m in missing]
