"""A random graph as plain data: the leaves (TensorSpec), the ops (Node), the graph (GraphSpec).

Why data, not a live module: the same spec renders as the module kiln compiles, as the
float64 reference and as a standalone repro (graph.py), and the minimiser edits it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "bool": torch.bool}
FLOATS = ("f32", "f16", "bf16")
DYN = "D"  # a shape entry that is the dynamic dim


def dtype_key(dt: torch.dtype) -> str:
    for k, v in DTYPES.items():
        if v == dt:
            return k
    if dt == torch.float64:
        return "f32"
    raise ValueError(f"unsupported dtype {dt}")


@dataclass
class TensorSpec:
    """A graph input, parameter or buffer: shape entries are ints or DYN."""

    name: str
    shape: tuple
    dtype: str
    high: int = 0  # i64 inputs: values in [0, high)


@dataclass
class Node:
    """One op: out = RENDER[op](ins, p). `stmts` ops (buffer writes) are statements."""

    out: str
    op: str
    ins: list[str]
    p: dict = field(default_factory=dict)


@dataclass
class GraphSpec:
    seed: int
    inputs: list[TensorSpec]
    params: list[TensorSpec] = field(default_factory=list)
    buffers: list[TensorSpec] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    dyn: tuple | None = None  # (min, max, example, [other call sizes])

    def clone(self) -> GraphSpec:
        return copy.deepcopy(self)

    def ops(self) -> list[str]:
        return sorted({n.op for n in self.nodes})

    def call_sizes(self) -> list[int | None]:
        if self.dyn is None:
            return [None]
        return [self.dyn[2], *self.dyn[3]]


class Spelling:
    """How dtypes are written: as themselves, or every float as float64 (the reference)."""

    def __init__(self, f64: bool = False):
        self.f64 = f64

    def dt(self, key: str) -> str:
        if self.f64 and key in FLOATS:
            return "torch.float64"
        return "torch." + str(DTYPES[key]).split(".")[1]
