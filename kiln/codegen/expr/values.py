"""The vocabulary generated code is written in: values, masks, dtypes, and the emitter's
interface as the per-op rules (elementwise.py, gather.py) see it.

Kept apart from emit.py so the per-op rules and the emitter that calls them do not
import each other: the rules get an `OpEmitter` and use only what it promises.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kiln.codegen.expr.indexing import Index, Lin
from kiln.codegen.expr.unsupported import CodegenUnsupported
from kiln.ir.symbolic import Dim


class EpilogueApart(CodegenUnsupported):
    """The template can run the region's anchor but not its epilogue: the region is
    split in two (kiln.dispatch.split.split_epilogue) rather than run extern."""


TL = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype PyTorch computes an op of result `dtype` in (fp16/bf16 math runs in fp32)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@dataclass(frozen=True)
class Val:
    """An emitted value: Triton `code` (a temp name or a literal) of torch `dtype`."""

    code: str
    dtype: torch.dtype
    vars: frozenset = frozenset()  # block variables it varies with (empty: a scalar)
    const: object = None  # the Python value, when `code` is a literal

    @property
    def block(self) -> bool:
        return bool(self.vars)

    def __str__(self) -> str:
        return self.code


def literal(value, dtype: torch.dtype) -> Val:
    if dtype == torch.bool:
        value = bool(value)
        return Val(str(value), dtype, frozenset(), value)
    if dtype.is_floating_point:
        value = float(value)
        if value != value:
            code = 'float("nan")'
        elif value in (float("inf"), float("-inf")):
            code = ('-' if value < 0 else '') + 'float("inf")'
        else:
            code = repr(value)
        return Val(code, dtype, frozenset(), value)
    value = int(value)
    return Val(str(value) if value >= 0 else f"({value})", dtype, frozenset(), value)


@dataclass(frozen=True)
class Cond:
    """One condition of a mask: Triton `code` over the kernel variables `vars`."""

    code: str
    vars: frozenset = field(default_factory=frozenset)


Mask = frozenset  # of Cond: their conjunction


def mask_of(*conds: Cond | None) -> Mask:
    return frozenset(c for c in conds if c is not None)


def mask_code(mask: Mask | None) -> str | None:
    if not mask:
        return None
    return " & ".join(sorted(f"({c.code})" if " " in c.code else c.code for c in mask))


class OpEmitter(Protocol):
    """What a per-op rule may ask of the kernel's emitter (kiln.codegen.expr.emit.Emitter)."""

    def value(self, name: str, index: Index, mask: Mask) -> Val: ...

    def operand(self, x, index: Index, mask: Mask, dtype: torch.dtype | None = None) -> Val: ...

    def let(self, code: str, dtype: torch.dtype, vars=frozenset()) -> Val: ...

    def cast(self, v: Val, dtype: torch.dtype) -> Val: ...

    def need(self, helper: str) -> str: ...

    def code(self, lin: Lin) -> str: ...

    def dim(self, d: Dim) -> str: ...

    def shape(self, name: str) -> tuple: ...

    def dtype(self, x) -> torch.dtype: ...

    def tensor(self, name: str) -> str: ...

    def opaque(self, v: Val, size: Dim | None) -> Lin: ...

    def check_index(self, v: Val, size: Dim, mask: Mask, what: str,
                    wraps: bool = False) -> None: ...

    def kept_in(self, v: Val, size: Dim) -> Val: ...
