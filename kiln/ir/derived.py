"""Tensors a pass derives from one of the model's tensors by a pure recipe.

Why: a pass may put a tensor of its own in a program, computed at compile time from a
model tensor's values (complex_products: the real [..., 2] pairs of Meta's complex64
RoPE table). The compile cache must never keep such values: another model instance
of the same program (another theta) would be served a stale table. A recorded
Derivation says how the tensor follows from its source, so the cache keeps the recipe
instead and replays it on the user's current tensor at every hit. A recipe is a list of
named steps from STEPS: text that survives an entry on disk, and nothing else runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import ArtifactError

# step name -> what it does; pure, deterministic, on the tensor's own device
STEPS = {
    # complex -> its (re, im) pairs in a new last dim of 2, dense (a view of a dense table)
    "view_as_real": lambda t: torch.view_as_real(t).contiguous(),
}


@dataclass(frozen=True)
class Derivation:
    """`source` (a state name of the model's tensors) through `steps`, in order."""

    source: str
    steps: tuple[str, ...]

    def __post_init__(self):
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown or not self.steps:
            raise ArtifactError(f"derivation of {self.source!r} has unknown steps {unknown}"
                                if unknown else f"derivation of {self.source!r} has no steps")

    def apply(self, source: torch.Tensor) -> torch.Tensor:
        """The derived tensor, computed from `source`'s current values."""
        with torch.no_grad():
            for step in self.steps:
                source = STEPS[step](source)
        return source

    def encode(self) -> dict:
        return {"source": self.source, "steps": list(self.steps)}

    @staticmethod
    def decode(entry: dict) -> Derivation:
        """From `encode`'s dict (read from disk); an ArtifactError if it is malformed."""
        if not isinstance(entry, dict) or not isinstance(entry.get("source"), str) \
                or not isinstance(entry.get("steps"), list) \
                or not all(isinstance(s, str) for s in entry["steps"]):
            raise ArtifactError(f"malformed derivation {entry!r}")
        return Derivation(entry["source"], tuple(entry["steps"]))
