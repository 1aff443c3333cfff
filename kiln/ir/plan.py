"""The dispatch-level IR: a DispatchPlan of regions, each one kind of fused work.

Every tensor that crosses a region boundary is a `TensorValue`: contiguous, row-major,
with a symbolic shape. Inside a region, `Op`s are core-ATen calls whose tensor
arguments are `Ref`s to region inputs or earlier ops; view ops stay in the op list
and act as index maps on what they read (no copies). A region's `outputs` are the
names of its ops whose results are materialised as plan values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from kiln.ir.symbolic import Bounds, Dim, numel


class RegionKind(StrEnum):
    POINTWISE = "pointwise"
    REDUCTION = "reduction"
    MATMUL = "matmul"
    ATTENTION = "attention"
    COPY = "copy"
    TOPK = "topk"
    EXTERN = "extern"


class Role(StrEnum):
    INPUT = "input"  # a user argument
    WEIGHT = "weight"  # a parameter or constant buffer
    STATE = "state"  # a buffer the model updates in place (KV cache)
    TEMP = "temp"  # an intermediate between regions: memory-planned
    OUTPUT = "output"  # returned to the user: freshly allocated each call


@dataclass(frozen=True)
class Ref:
    """A tensor argument: the name of a region input value or an earlier op."""

    name: str


@dataclass(frozen=True)
class Sym:
    """A symbolic int argument (a size), evaluated from the bound symbols at run time."""

    expr: Dim


@dataclass
class TensorValue:
    name: str
    shape: tuple[Dim, ...]
    dtype: torch.dtype
    role: Role
    target: str | None = None  # state-dict name for weights / state

    @property
    def numel(self) -> Dim:
        return numel(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Op:
    name: str
    target: str  # 'aten.mul.Tensor', 'getitem', ...
    args: tuple
    kwargs: dict
    shape: tuple[Dim, ...] | None  # None for tuple-valued ops (read through getitem)
    dtype: torch.dtype | None
    where: str | None = None  # the user's source line

    def refs(self) -> list[str]:
        out: list[str] = []
        _collect_refs(self.args, out)
        _collect_refs(tuple(self.kwargs.values()), out)
        return out


def _collect_refs(x, out: list[str]) -> None:
    if isinstance(x, Ref):
        out.append(x.name)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _collect_refs(y, out)


@dataclass
class Region:
    name: str
    kind: RegionKind
    ops: list[Op]
    inputs: list[str]  # plan values read
    outputs: list[str]  # ops materialised as plan values (same names)
    inplace: dict[str, str] = field(default_factory=dict)  # output -> state value it writes
    notes: list[str] = field(default_factory=list)  # why it was split, fused, ...
    device: int = 0
    label: str | None = None  # the LLM pattern of its anchor ("rmsnorm", "attention", ...)
    # attention: the values holding, per mask row, the first key the mask lets through,
    # one past the last and how many keys it passes unchanged (dispatch/mask_envelope.py);
    # the key loop stays inside them. No count (None) for a mask whose form passes each
    # row a prefix of the keys, unchanged (dispatch/prefix_mask.py): plain in every tile
    key_bounds: tuple[str, str, str | None] | None = None
    # attention: the name of the copy region whose cache writes it took over (dispatch/
    # fold_cache_writes.py), put back apart if its template declines them; not saved
    folded_writes: str | None = None

    def key_bound_values(self) -> list[str]:
        """The plan values key_bounds names (the count absent for a prefix mask)."""
        return [b for b in self.key_bounds or () if b is not None]

    def op(self, name: str) -> Op:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)

    def anchor(self) -> Op:
        """The op that gives the region its kind (the matmul, the reduction, ...)."""
        from kiln.ir.ops import OpCategory, category

        want = {
            RegionKind.MATMUL: {OpCategory.MATMUL},
            RegionKind.ATTENTION: {OpCategory.ATTENTION},
            RegionKind.REDUCTION: {OpCategory.REDUCTION},
            RegionKind.EXTERN: {OpCategory.EXTERN},
            RegionKind.TOPK: {OpCategory.TOPK},
            RegionKind.COPY: {OpCategory.SCATTER, OpCategory.GATHER, OpCategory.CONCAT},
        }.get(self.kind, set())
        for o in self.ops:
            if category(o.target) in want:
                return o
        return self.op(self.outputs[0])

    def where(self) -> list[str]:
        seen: list[str] = []
        for o in self.ops:
            if o.where and o.where not in seen:
                seen.append(o.where)
        return seen


@dataclass
class DispatchPlan:
    symbols: dict[str, Bounds]
    values: dict[str, TensorValue]
    regions: list[Region]
    user_inputs: list[str]  # tensor arguments (plan values), in flattened argument order
    outputs: list[str]  # plan values, in flattened output order
    # state values updated functionally: after a call, state[target] <- value
    state_writes: dict[str, str] = field(default_factory=dict)
    # non-tensor arguments export specialised on: flat leaf index -> the value compiled for
    const_args: dict[int, object] = field(default_factory=dict)
    # dynamic int arguments (sizes): (flat leaf index, argument name, its size symbol)
    size_args: list[tuple[int, str, str]] = field(default_factory=list)
    # conditions over the sizes every call must meet, beyond each symbol's Bounds:
    # (lhs - rhs, relation, text), the guards torch took over the int arguments
    size_checks: list[tuple[Dim, str, str]] = field(default_factory=list)
    in_spec: str = ""  # pytree TreeSpec, serialised
    out_spec: str = ""
    devices: list[int] = field(default_factory=lambda: [0])
    # size symbol -> the user's torch.export.Dim name, so errors say `dim "seq"`
    dim_names: dict[str, str] = field(default_factory=dict)
    # pipeline stage boundaries: values received before a call (from the stage that
    # produces them) and sent after it (to the later stages that read them)
    recv: list[tuple[str, int]] = field(default_factory=list)
    send: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)
    # flattened output positions where the model returns None (frontend/none_outputs):
    # the module puts None there, between the `outputs` tensors
    none_outputs: list[int] = field(default_factory=list)

    @property
    def int_symbols(self) -> frozenset[str]:
        """The size symbols of the int arguments: integers that may be 0, not positive
        as a tensor dim's are (what `parse` needs to read this plan's dims back)."""
        return frozenset(sym for _, _, sym in self.size_args)

    def region(self, name: str) -> Region:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(name)

    def producers(self) -> dict[str, Region]:
        return {out: r for r in self.regions for out in r.outputs}

    def last_uses(self) -> dict[str, int]:
        """For each value, the index of the last region that reads it."""
        last: dict[str, int] = {}
        for i, r in enumerate(self.regions):
            for v in r.inputs:
                last[v] = i
        return last
