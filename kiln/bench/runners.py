"""How each runner turns the Subject into a prefill and a decode callable.

All three run the same module object, weights and cache: eager calls it; torch.compile
compiles it as gpt-fast does (default mode for prefill, `reduce-overhead` (CUDA graphs)
with fullgraph for decode on a GPU); kiln compiles a prefill module with a dynamic
sequence dim and a decode module for one token (CUDA graphs on a GPU), as
`kiln generate` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

RUNNERS = ("eager", "torch.compile", "kiln")

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Runner:
    """One runner's prefill and decode for one batch size, built on first use."""

    name: str
    model: torch.nn.Module
    device: str
    _steps: dict[str, Step] = field(default_factory=dict)

    def step(self, phase: str) -> Step:
        if phase not in self._steps:
            self._steps[phase] = self._build(phase)
        return self._steps[phase]

    def _build(self, phase: str) -> Step:
        if self.name == "eager":
            return self.model
        if self.name == "torch.compile":
            return _torch_compiled(self.model, phase, self.device)
        if self.name == "kiln":
            return _kiln_compiled(self.model, phase, self.device)
        raise ValueError(f"unknown runner {self.name!r}")


def _torch_compiled(model, phase: str, device: str) -> Step:
    import torch._dynamo

    # every batch size is another module object (and so another compile) of one forward
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    if phase == "decode" and device == "cuda":
        return torch.compile(model, mode="reduce-overhead", fullgraph=True)
    return torch.compile(model)


def _kiln_compiled(model, phase: str, device: str) -> Step:
    import kiln

    target = "cuda" if device == "cuda" else "cpu"
    b, max_len = model.batch, model.shape.max_len
    if phase == "prefill":
        seq = kiln.Dim("seq", min=2, max=max_len)
        ex = (torch.zeros(b, 16, dtype=torch.long, device=device),
              torch.arange(16, device=device))
        return kiln.compile(model, ex, dynamic_shapes=({1: seq}, {0: seq}), target=target)
    ex = (torch.zeros(b, 1, dtype=torch.long, device=device),
          torch.zeros(1, dtype=torch.long, device=device))
    module = kiln.compile(model, ex, target=target)
    if device == "cuda":
        module.cuda_graphs()
    return module
