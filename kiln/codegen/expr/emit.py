"""The expression emitter: a region's ops as Triton code at any index.

Every generator and template uses one `Emitter` per kernel. Its contract:

    args = KernelArgs()
    em = Emitter(region, plan, args, target, overrides={"mm": acc_at})
    v = em.value("add_159", index, mask)   # code computing op add_159 at `index`
    em.store("add_159", index, v, mask)     # write a region output there

- `index` is a tuple of `indexing.Lin`, one per dim of the value asked for, built from
  the kernel's own variables (`Lin.of(Var("xindex", n))`, `Var("offs_m", M)`, ...).
- `value(name, index, mask)` appends the lines computing value `name` (a region input
  or an op) at that index to `em.lines` and returns a `Val` (its code: a temp name or a
  literal, and its torch dtype). Region inputs are loaded through their index maps:
  views compose into the offset, broadcasting reads index 0, gathers load indirectly,
  cat / constant_pad select per element. Each op rounds its result to its own dtype,
  computing in fp32 where PyTorch does (fp16/bf16 math), so numerics follow eager.
- `mask` is a `Mask` (the conjunction of `Cond`s a template defines, e.g. the tail
  mask `xmask` on var `xindex`); loads keep the conditions on the variables their
  offset uses, so a weight row read at `rindex` in a 2-D tile needs no x mask.
- `overrides` maps op names the template computes itself (the matmul accumulator, a
  row reduction) to a callable `index -> Val | None`; None means "not at this index",
  which makes the region unsupported rather than wrong.
- Results are cached per (value, index); `with em.block() as lines:` opens a nested
  scope (a loop body) whose lines the template places and whose cache it drops.
- Anything the emitter cannot express raises CodegenUnsupported: the generator returns
  None and the region runs extern with a note. It never emits wrong code instead.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kiln.codegen.build.interpreter import INDEX_CHECK
from kiln.codegen.expr.indexing import (
    Index,
    Lin,
    Opaque,
    Var,
    broadcast_index,
    linearize,
    may_exceed_int32,
)
from kiln.codegen.expr.jit_helpers import helper_source
from kiln.codegen.expr.kernel_args import KernelArgs
from kiln.codegen.expr.values import (
    TL,
    CodegenUnsupported,
    Cond,
    Mask,
    Val,
    literal,
    mask_code,
    mask_of,
    opmath,
)
from kiln.codegen.expr.views import dim_value, is_view, source_index
from kiln.ir.ops import (
    ARANGES,
    IDENTITY_OPS,
    SLICE_SCATTERS,
    OpCategory,
    arange_start_step,
    category,
)
from kiln.ir.plan import DispatchPlan, Op, Ref, Region, Sym
from kiln.ir.symbolic import Dim, numel
from kiln.target import Target

__all__ = ["TL", "CodegenUnsupported", "Cond", "Emitter", "KernelArgs", "Mask", "Opaque", "Val",
           "Var", "indent", "kernel_name", "literal", "mask_code", "mask_of", "module_source",
           "needs_int64", "opmath"]

# ---------------------------------------------------------------- the emitter


class Emitter:
    def __init__(self, region: Region, plan: DispatchPlan, args: KernelArgs, target: Target,
                 overrides: dict | None = None, prefix: str = "t",
                 written_first: tuple[str, ...] = ()):
        self.region = region
        self.plan = plan
        self.args = args
        self.target = target
        self.ops = {o.name: o for o in region.ops}
        self.overrides = dict(overrides or {})
        # in-place scatters whose kernel stores every element it reads before reading it
        # (a decode attention's folded cache writes): read from their state's memory
        self.written_first = frozenset(written_first)
        self.prefix = prefix
        self.lines: list[str] = []
        self.helpers: set[str] = set()  # names of jit helper functions the code calls
        self._scopes: list[dict] = [{}]
        self._n = 0

    # facts about values ----------------------------------------------------
    def shape(self, name: str) -> tuple:
        if name in self.ops:
            op = self.ops[name]
            if op.shape is None:
                raise CodegenUnsupported(f"%{name} is a tuple; read it through getitem")
            return tuple(op.shape)
        return tuple(self.plan.values[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        if name in self.ops:
            return self.ops[name].dtype
        return self.plan.values[name].dtype

    def dim(self, d: Dim) -> str:
        return self.args.dim(d)

    def code(self, lin) -> str:
        return Lin.of(lin).code(self.args.dim)

    # emitting ---------------------------------------------------------------
    def let(self, expr: str, dtype: torch.dtype, vars: frozenset = frozenset()) -> Val:
        """Assign `expr` to a fresh temp; `vars`: the block variables it varies with."""
        name = f"{self.prefix}{self._n}"
        self._n += 1
        self.lines.append(f"{name} = {expr}")
        return Val(name, dtype, frozenset(vars))

    def need(self, helper: str) -> None:
        self.helpers.add(helper)

    def cast(self, v: Val, dtype: torch.dtype) -> Val:
        if v.dtype == dtype:
            return v
        if v.const is not None:
            return literal(v.const, dtype)
        if dtype == torch.bool:
            return self.let(f"{v.code} != 0", dtype, v.vars)
        if dtype == torch.bfloat16 and v.dtype in (torch.float32, torch.float64):
            # GPUs round to nearest even, as torch does; Triton's interpreter truncates, so
            # the interpret target rounds in a helper
            src = v if v.dtype == torch.float32 else self.cast(v, torch.float32)
            if self.target.backend == "interpret":
                self.need("_to_bf16")
                return self.let(f"_to_bf16({self.tensor(src).code})", dtype, v.vars)
            return self.let(f"{src.code}.to(tl.bfloat16)", dtype, v.vars)
        return self.let(f"{v.code}.to({TL[dtype]})", dtype, v.vars)

    def tensor(self, v: Val) -> Val:
        """`v` as a Triton value (a literal becomes a 0-d tensor), e.g. for jit helpers."""
        if v.const is None:
            return v
        return self.let(f"tl.full([], {v.code}, {TL[v.dtype]})", v.dtype)

    @contextmanager
    def block(self):
        """A nested scope (a loop body): its own lines and cache; the caller places them."""
        saved = self.lines
        self.lines = []
        self._scopes.append({})
        try:
            yield self.lines
        finally:
            self._scopes.pop()
            self.lines = saved

    # values ---------------------------------------------------------------------
    def value(self, name: str, index, mask: Mask | None = None) -> Val:
        """Code computing value `name` (region input or op) at `index`, under `mask`."""
        index = tuple(Lin.of(i) for i in index)
        mask = frozenset(mask or ())
        key = (name, index)
        for scope in reversed(self._scopes):
            for cached_mask, v in scope.get(key, ()):
                if cached_mask <= mask:  # computed on at least the lanes needed now
                    return v
        if name in self.overrides:
            v = self.overrides[name](index)
            if v is None:
                raise CodegenUnsupported(f"%{name} is not available at index {index}")
            if isinstance(v, str):
                v = Val(v, self.dtype(name), frozenset().union(*(i.var_names() for i in index)))
        elif name in self.written_first:
            v = self.load(name, index, mask)
        elif name in self.ops:
            v = self._op(self.ops[name], index, mask)
        elif name in self.region.inputs:
            v = self.load(name, index, mask)
        else:
            raise CodegenUnsupported(f"%{name} is neither an input nor an op of the region")
        self._scopes[-1].setdefault(key, []).append((mask, v))
        return v

    def operand(self, op: Op, arg, index: Index, mask: Mask) -> Val:
        """An argument of elementwise op `op` at output index `index` (broadcast)."""
        if isinstance(arg, Ref):
            shape = self.shape(arg.name)
            return self.value(arg.name, broadcast_index(index, op.shape, shape), mask)
        if isinstance(arg, Sym):
            return self.let(f"{self.dim(arg.expr)}.to(tl.int64)", torch.int64)
        if isinstance(arg, bool):
            return literal(arg, torch.bool)
        if isinstance(arg, int):
            return literal(arg, torch.int64)
        if isinstance(arg, float):
            return literal(arg, torch.float64)
        raise CodegenUnsupported(f"argument {arg!r} of {op.target} is not a tensor or number")

    def load(self, name: str, index: Index, mask: Mask | None) -> Val:
        """Load region input `name` (or a `written_first` output: its state's memory),
        contiguous row-major, at `index`."""
        shape = self.shape(name)
        dtype = self.dtype(name)
        off = linearize(index, shape)
        ptr = self.args.tensor(name, dtype, shape)
        if not off.block:
            return self.let(f"tl.load({ptr} + {self.code(off)})", dtype)
        used = off.var_names()
        m = mask_code(frozenset(c for c in (mask or ()) if c.vars <= used))
        tail = f", mask={m}, other=0" if m else ""
        return self.let(f"tl.load({ptr} + ({self.code(off)}){tail})", dtype, used)

    def store(self, name: str, index, v: Val, mask: Mask | None, like: str | None = None,
              dest: str | None = None, atomic_add: bool = False, span: tuple = ()) -> None:
        """Write `v` as element `index` of region output `name` (or of value `dest`).

        `like` names a block variable of the kernel (e.g. `xindex`): a store whose offset
        is a constant is widened to its shape so it can carry the mask. `span` names the
        block variables a tile's store covers: an offset lacking some (a size-1 dim is
        read at the constant 0) is widened by them, so the pointer block has the value's
        and the mask's shape. `atomic_add` adds `v` to the element instead (relaxed: the
        kernel's end orders it).
        """
        target = dest or name
        shape = self.plan.values[target].shape if target in self.plan.values else self.shape(name)
        dtype = self.plan.values[target].dtype if target in self.plan.values else v.dtype
        off = linearize(tuple(Lin.of(i) for i in index), shape)
        ptr = self.args.tensor(target, dtype, shape, output=True)
        v = self.cast(v, dtype)
        offc = self.code(off)
        if not off.block and like:
            offc = f"{offc} + 0 * {like}"
        for var in (x for x in span if x not in off.var_names()):
            offc = f"{offc} + 0 * {var}"
        m = mask_code(mask)
        if atomic_add:
            self.lines.append(f"tl.atomic_add({ptr} + ({offc}), {v.code}"
                              f"{f', mask={m}' if m else ''}, sem=\"relaxed\")")
            return
        self.lines.append(f"tl.store({ptr} + ({offc}), {v.code}{f', {m}' if m else ''})")

    # ops --------------------------------------------------------------------------
    def _op(self, op: Op, index: Index, mask: Mask) -> Val:
        from kiln.codegen.expr import elementwise, gather

        if op.target in IDENTITY_OPS:
            return self.value(op.args[0].name, index, mask)
        if is_view(op, self.ops):
            src, sidx = source_index(op, index, self.shape, self.ops)
            return self.value(src, sidx, mask)
        cat = category(op.target)
        if cat == OpCategory.CREATE:
            return self._create(op, index)
        if cat == OpCategory.GATHER:
            return gather.emit_gather(self, op, index, mask)
        if cat == OpCategory.CONCAT:
            return gather.emit_concat(self, op, index, mask)
        if cat == OpCategory.POINTWISE:
            return elementwise.emit(self, op, index, mask)
        if op.target in SLICE_SCATTERS:
            return gather.emit_scatter_select(self, op, index, mask)
        raise CodegenUnsupported(f"{op.target} (%{op.name}) cannot be computed per element here")

    def _create(self, op: Op, index: Index) -> Val:
        t = op.target
        a = op.args
        if t in ARANGES:
            start, step = arange_start_step(op)
            return self._ramp(op, index[0], start, step)
        if t == "aten.iota.default":  # a prims op: no ATen schema to bind by
            return self._ramp(op, index[0], op.kwargs.get("start", 0), op.kwargs.get("step", 1))
        if t in ("aten.full.default", "aten.full_like.default"):
            return self._scalar(a[1], op.dtype)
        if t == "aten.scalar_tensor.default":
            return self._scalar(a[0], op.dtype)
        if t in ("aten.zeros.default", "aten.zeros_like.default", "aten.empty.memory_format",
                 "aten.empty_like.default", "aten.empty_permuted.default"):
            return literal(0, op.dtype)
        if t in ("aten.ones.default", "aten.ones_like.default"):
            return literal(1, op.dtype)
        raise CodegenUnsupported(f"{t} is not generated inline")

    def _scalar(self, x, dtype: torch.dtype) -> Val:
        """A fill value: a number, or a size (Sym) read from its kernel argument."""
        if isinstance(x, Sym):
            return self.cast(self.let(f"{self.dim(x.expr)}.to(tl.int64)", torch.int64), dtype)
        return literal(x, dtype)

    def _ramp(self, op: Op, i: Lin, start, step) -> Val:
        """start + i * step in op.dtype (an arange)."""
        if any(isinstance(x, float) for x in (start, step)) or op.dtype.is_floating_point:
            start, step = float(_num(start)), float(_num(step))
            idx = self.let(f"({self.code(i)})", torch.int64, i.var_names())
            pos = self.cast(idx, torch.float32)
            v = self.let(f"{start!r} + {pos.code} * {step!r}", torch.float32, i.var_names())
            return self.cast(v, op.dtype)
        lin = Lin.of(dim_value(start)) + i * dim_value(step)
        if lin.is_const and isinstance(lin.const, int):
            return literal(lin.const, op.dtype)
        v = self.let(f"({self.code(lin)}).to(tl.int64)", torch.int64, lin.var_names())
        return v if op.dtype == torch.int64 else self.cast(v, op.dtype)

    def opaque(self, v: Val, size: Dim | None) -> Lin:
        """An emitted integer value used as an index into a dim of `size`."""
        return Lin.of(Opaque(v.code, size, v.vars))

    def kept_in(self, v: Val, size: Dim) -> Val:
        """Index `v` clamped into [0, size): on a GPU, where nothing checks a loaded
        index, one out of range (a token id past the vocabulary, a position past a
        static cache) reads or writes an element of its own tensor, not memory past it
        (another tensor, or an illegal-address fault that ends the process's CUDA
        context). Eager PyTorch refuses such an index; the interpret target raises
        first (check_index)."""
        return self.let(f"tl.minimum(tl.maximum({v.code}, 0), {self.dim(size)} - 1)",
                        v.dtype, v.vars)

    def check_index(self, v: Val, size: Dim, mask: Mask | None, what: str,
                    wraps: bool = False) -> None:
        """On the interpret target, a check that index `v` (loaded from a tensor) lies in
        [0, size) on the lanes of `mask` ([-size, size) if torch `wraps` it): the
        interpreter would read or write host memory past the tensor
        (build/interpreter.py); `what` (the op) goes in its message. GPU targets check
        nothing: a check on every call costs time there."""
        if self.target.backend != "interpret":
            return
        size = self.dim(size)
        ok = f"({v.code} >= {f'-{size}' if wraps else 0}) & ({v.code} < {size})"
        m = mask_code(mask)
        self.lines.append(f'tl.device_assert({ok}, "{INDEX_CHECK} ({what})"'
                          f'{f", mask={m}" if m else ""})')


def _num(x):
    if isinstance(x, Sym):
        raise CodegenUnsupported("a floating arange with a symbolic bound")
    return x


def indent(lines: list[str], n: int = 1) -> list[str]:
    pad = "    " * n
    return [pad + ln for ln in lines]


def module_source(name: str, params: list[str], body: list[str], helpers: set[str],
                  target: Target, doc: list[str]) -> str:
    """A whole kernel module: imports, the helper jit functions the body calls, the kernel."""
    head = ["import triton", "import triton.language as tl"]
    helper_code = [helper_source(h, target) for h in sorted(helpers)]
    if any("libdevice." in h for h in helper_code):
        head.append("from triton.language.extra import libdevice")
    parts = ["\n".join(head)]
    for h in helper_code:
        parts += ["", "", h.strip()]
    parts += ["", "", "@triton.jit", f"def {name}({', '.join(params)}):"]
    parts += indent(doc) + indent(body)
    return "\n".join(parts) + "\n"


def kernel_name(kind: str, region: Region) -> str:
    """A readable kernel name from the kind and the region's main ops: the same for every
    layer's copy of a region, so identical layers share one kernel source."""
    skip = {OpCategory.VIEW, OpCategory.TUPLE, OpCategory.CREATE}
    words: list[str] = []
    for op in region.ops:
        if category(op.target) in skip or op.target in IDENTITY_OPS:
            continue
        w = op.target.split(".")[1].strip("_").replace("_to_copy", "to").replace("_", "")
        if w not in words:
            words.append(w)
    return "_".join(["kiln", kind] + words[:4])


def needs_int64(region: Region, plan: DispatchPlan, extra=()) -> bool:
    """64-bit indexing when some tensor the kernel touches may exceed 2**31 - 1 elements."""
    sizes = [plan.values[v].numel for v in list(region.inputs) + list(region.outputs)
             if v in plan.values]
    sizes += [numel(op.shape) for op in region.ops if op.shape is not None]
    return may_exceed_int32(sizes + list(extra), plan.symbols)
