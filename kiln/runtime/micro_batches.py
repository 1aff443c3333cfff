"""How a pipeline call is cut into micro-batches, and its outputs joined again.

GPipe's point: with M micro-batches, stage s works on micro-batch m while stage s+1
works on m-1, so P stages idle (P-1)/(M+P-1) of a call instead of (P-1)/P. Two cuts:

- "batch": rows are independent sequences. Micro-batch m is rows [m*b, (m+1)*b),
  b = B/M (M must divide B: a sequence must land in the same micro-batch on every
  call). Each micro-batch has its own copy of the stage's state ("slot" m, as vLLM's
  virtual engines each own a KV cache), because a contiguous cache keeps a call's row
  r in cache row r: micro-batch m's rows are rows 0..b-1 of slot m. A paged cache is
  as right (each sequence's blocks are written and read in its own slot), only wider.
  Keep B and M the same from a batch's prefill through its decode steps.
- "sequence": chunked prefill of a causal model with a KV cache (SARATHI, vLLM). Chunk
  m is tokens [m*c, (m+1)*c) of every row and attends to what chunks 0..m-1 left in
  the cache, which a stage has written before it runs chunk m: one state, no copies.
  Wrong for a model without a cache (chunks would not see each other), so a stage
  that writes no state refuses it; uneven chunks are fine (torch.chunk's sizes).

The cut dim is a size symbol: dim 0 (batch) or dim 1 (sequence) of the first input,
or the torch.export.Dim named by `dim=`. Inputs holding it are cut along it, the
rest go whole to every micro-batch (a [T] input_pos shared by the rows); every output
must hold it, to be joined along it (logits at chosen positions are not: a sequence
cut would move them).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch

from kiln.errors import ArgumentError, ShapeError
from kiln.ir.plan import DispatchPlan, Role
from kiln.runtime.guards import dim_label

SPLITS = ("batch", "sequence")


def _axis_of(shape, sym) -> int | None:
    return next((d for d, s in enumerate(shape) if s == sym), None)


@dataclass(frozen=True)
class MicroBatches:
    count: int
    split: str
    symbol: sympy.Symbol
    cut: tuple[int | None, ...]  # per user input: the axis cut, None = whole
    join: tuple[int, ...]  # per user output: the axis joined along
    label: str  # how messages name the cut dim

    @property
    def slots(self) -> int:
        """State copies a stage keeps: one per micro-batch for a batch cut."""
        return self.count if self.split == "batch" else 1

    def pieces(self, flat: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """The call's inputs as M (or fewer, for short sequences) micro-batches."""
        size = next((t.shape[a] for t, a in zip(flat, self.cut)
                     if a is not None and a < t.dim()), None)
        if size is None or self.count == 1:
            return [flat]
        if self.split == "batch" and size % self.count:
            raise ShapeError(
                f"a batch of {size} rows ({self.label}) cannot be cut into {self.count} equal "
                "micro-batches",
                hint=f"call with a multiple of {self.count} rows, or set micro_batches to a "
                f"divisor of {size}")
        parts = [list(t.chunk(self.count, a)) if a is not None else None
                 for t, a in zip(flat, self.cut)]
        n = len(next(p for p in parts if p is not None))
        return [[p[m] if p is not None else t for p, t in zip(parts, flat)] for m in range(n)]

    def joined(self, outs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """Micro-batches' outputs, concatenated back along the cut dim."""
        if len(outs) == 1:
            return outs[0]
        return [torch.cat(parts, axis) for parts, axis in zip(zip(*outs), self.join)]


def plan_micro_batches(plan: DispatchPlan, count, split: str = "batch",
                       dim: str | None = None) -> MicroBatches:
    """Check `count`/`split`/`dim` against a stage's plan and say where each input is cut."""
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ArgumentError(f"micro_batches must be a positive int, got {count!r}",
                            hint="1 runs each call whole; M > 1 pipelines M micro-batches")
    if split not in SPLITS:
        raise ArgumentError(f"micro-batch split {split!r} is not one of {', '.join(SPLITS)}",
                            hint='"batch" cuts rows (prefill and decode); "sequence" cuts a '
                            "causal prefill into chunks")
    shapes = [plan.values[v].shape for v in plan.user_inputs]
    if dim is not None:
        sym = next((s for s, n in plan.dim_names.items() if n == dim), None)
        if sym is None:
            raise ArgumentError(f"the module has no dynamic dim named {dim!r}",
                                hint=f"its dims: {sorted(plan.dim_names.values())}")
        sym = sympy.Symbol(sym, integer=True, positive=True)
    else:
        axis = 0 if split == "batch" else 1
        first = shapes[0] if shapes else ()
        sym = first[axis] if len(first) > axis else None
        if not isinstance(sym, sympy.Symbol):
            what = "batch (dim 0)" if split == "batch" else "sequence (dim 1)"
            raise ShapeError(
                f"micro-batches cut the {what} of the first argument, and the module was "
                f"compiled with it {'static' if sym is not None else 'missing'}"
                + (f" ({sym})" if sym is not None else ""),
                hint="mark that dim dynamic (dynamic_shapes={0: Dim('batch')} for the batch), "
                "or name the dim to cut with dim=")
    label = dim_label(plan, sym.name)
    join = []
    for i, out in enumerate(plan.outputs):
        axis = _axis_of(plan.values[out].shape, sym)
        if axis is None:
            raise ShapeError(
                f"output {i} {list(plan.values[out].shape)} has no {label}, so micro-batches "
                "cut along it cannot be joined again",
                hint="use micro_batches=1 for this module (e.g. logits at chosen positions), "
                "or cut another dim")
        join.append(axis)
    if split == "sequence" and count > 1 and not any(
            v.role == Role.STATE for v in plan.values.values()):
        raise ArgumentError(
            "a sequence cut (chunked prefill) needs a KV cache: later chunks read what earlier "
            "ones wrote there, and this stage keeps no state",
            hint='give the model a cache (setup_cache), or cut the batch: split="batch"')
    cut = tuple(_axis_of(s, sym) for s in shapes)
    return MicroBatches(count, split, sym, cut, tuple(join), label)
