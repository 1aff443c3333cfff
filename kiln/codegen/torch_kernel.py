"""A region run op by op through PyTorch: the CPU target's kernels and the extern path.

Each op is the same ATen call the graph holds, so results match eager PyTorch.
Outputs are written into the buffers the memory planner assigned: directly through
the op's `out=` overload where ATen has one, else by a copy. In kiln's value
semantics a `view` is a logical reshape, so it runs as `reshape` (our producers'
layouts need not match eager's strides). For the same reason an input may arrive as a
strided view (a transpose runs as a permute): the few ATen kernels that refuse one
get their input made contiguous (CONTIGUOUS_ARGS), as eager's composite wrappers do.
"""

from __future__ import annotations

import functools
import re

import torch

from kiln.codegen.integer_products import integer_product
from kiln.errors import IndexOutOfRangeError
from kiln.ir.ops import INPLACE_OF, STRICT_VIEWS, resolve
from kiln.ir.plan import Op, Ref, Region, Sym
from kiln.ir.printer import print_region
from kiln.ir.symbolic import compile_expr


@functools.cache
def out_overload(name: str):
    """The `out=` overload with the same arguments (names and types) as `name`, if any."""
    if name == "getitem":
        return None
    ns, op, overload = name.split(".")
    packet = getattr(getattr(torch.ops, ns), op)
    want = [(a.name, str(a.type)) for a in getattr(packet, overload)._schema.arguments]
    for o in packet.overloads():
        schema = getattr(packet, o)._schema
        outs = [a for a in schema.arguments if a.is_out]
        rest = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
        if len(outs) == 1 and outs[0].name == "out" and rest == want:
            return getattr(packet, o)
    return None


@functools.cache
def callable_for(name: str):
    return resolve("aten.reshape.default" if name in STRICT_VIEWS else name)


# creations whose elements are whatever the allocator held
UNINITIALIZED = {"aten.empty.memory_format", "aten.empty_like.default",
                 "aten.empty_permuted.default", "aten.empty_strided.default"}


def _zeroed(create):
    def zeroed(*args, **kwargs):
        return create(*args, **kwargs).zero_()
    return zeroed


def _constant(value):
    return lambda local: value


def entry_point(fn):
    """An OpOverload's C++ entry point (skips a Python frame per call); else fn."""
    return getattr(fn, "_op", fn)


_CONSTANT = object()

# Views of one region input, kept from call to call while it is the same tensor at the
# same address (a weight, a planned buffer; an intermediate is new each call and the
# memo would only hold it alive). Why: a GPU prefill's extern matmul region (permute
# the weight, view the activation, mm) spent ~8 us of host on each view in a 327-launch
# Llama-3-8B prefill of 128 tokens on an H200 host, where the whole call is host-bound
# (~8 ms of host for ~6 ms of kernels).
MEMO_VIEWS = {"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
              "aten.permute.default", "aten.transpose.int", "aten.t.default",
              "aten.expand.default", "aten.unsqueeze.default", "aten.squeeze.default",
              "aten.squeeze.dim", "aten.squeeze.dims", "aten.slice.Tensor",
              "aten.select.int", "aten.alias.default", "aten.diagonal.default",
              "aten.unfold.default"}

# Ops whose ATen kernel requires contiguous tensors at these argument positions (eager
# calls them through wrappers that make the input contiguous first: F.group_norm; or
# the model did, with a .contiguous() that kiln's strideless values drop).
CONTIGUOUS_ARGS = {"aten.native_group_norm.default": (0,), "aten.view_as_complex.default": (0,)}


# out= overloads that write in the out tensor's own strides. Every other one is checked
# after each call: CUDA's pooling kernels (avg_pool2d, max_pool2d_with_indices, ...)
# restride their out tensor in place to the input's suggested memory format (channels
# last for a transposed input), so a kernel reading the planned buffer densely read
# scrambled values (SEW's pooled transpose on an H200, 2026-11-30; right on the CPU,
# whose kernels keep the out tensor's strides). The matmuls skip the ~0.5 us check
# (mode "out"; every other out= op runs as "out_checked").
KEEPS_OUT_STRIDES = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                     "aten.baddbmm.default", "aten._scaled_mm.default"}


def _restore_strides(dest: torch.Tensor, strides: tuple[int, ...]) -> None:
    """Put the values an op wrote in its own layout back into the planned layout."""
    written = dest.clone()
    dest.as_strided_(dest.shape, strides, dest.storage_offset())
    dest.copy_(written)


def _contiguous(binder):
    return lambda local: binder(local).contiguous()


class BoundOps:
    """A torch region's ops bound to a set of sizes (TorchKernel.bind)."""

    __slots__ = ("inputs", "outputs", "steps", "ops")

    def __init__(self, region: Region, steps: list):
        self.inputs = list(region.inputs)
        self.outputs = list(region.outputs)
        self.steps = steps
        self.ops = list(region.ops)

    def __call__(self, values: dict[str, torch.Tensor], stream: int) -> None:
        local = {i: values[i] for i in self.inputs}  # intermediates, freed at the end
        for op, step in zip(self.ops, self.steps):
            try:
                self._step(step, values, local)
            except (IndexError, RuntimeError) as e:  # the user's data, or a kiln bug
                if not is_bad_index(e):
                    raise
                raise index_error(op, e) from e
        for o in self.outputs:
            if local[o] is not values[o]:
                values[o].copy_(local[o])

    @staticmethod
    def _step(step, values: dict[str, torch.Tensor], local: dict) -> None:
        name, fn, fixed, slots, fixed_kw, kslots, mode, plain, memo = step
        if mode == "view":  # the same source tensor as last call: the same view
            src = slots[0][1](local)
            if memo[0] is src and memo[1] == src.data_ptr():
                local[name] = memo[2]
                return
            args = list(fixed)
            args[0] = src
            out = local[name] = plain(*args, **fixed_kw)
            # a reshape that had to copy is a new tensor each call: never kept
            memo[:] = (src, src.data_ptr(), out) if out._is_view() else (None, None, None)
            return
        args = fixed
        if slots:
            args = list(fixed)
            for j, b in slots:
                args[j] = b(local)
        kwargs = fixed_kw
        if kslots:
            kwargs = dict(fixed_kw)
            for k, b in kslots:
                kwargs[k] = b(local)
        if mode == "inplace":
            dest = values[name]
            fn(dest, *args[1:], **kwargs)
            local[name] = dest
        elif mode == "out" and name in values:
            dest = values[name]
            fn(*args, **kwargs, out=dest)
            local[name] = dest
        elif mode == "out_checked" and name in values:
            dest = values[name]
            strides = dest.stride()
            fn(*args, **kwargs, out=dest)
            if dest.stride() != strides:
                _restore_strides(dest, strides)
            local[name] = dest
        else:
            local[name] = plain(*args, **kwargs)


class TorchKernel:
    """Runs `region` with torch ops on whatever device its tensors live on.

    On the CPU target every region runs this way, so its per-op host cost is the
    module's: each op's arguments are bound once per set of sizes (constants and
    symbolic sizes kept, only the references to values filled in per call), and the
    ATen op is called through its C++ entry point.
    """

    kind = "torch"

    def __init__(self, region: Region, device: str | torch.device = "cpu", *,
                 zeroed: bool = False):
        """zeroed: memory a region creates uninitialised (aten.empty) reads as zeros, as
        in a generated kernel: the form the tuner checks candidates against. A region
        may return such elements unwritten (a slice_scatter into an `empty` whose other
        slice the next region fills: MLA's key in Mistral 4), and garbage there is no
        verdict on a candidate."""
        self.region = region
        self.device = torch.device(device)
        integer = [integer_product(op.target, op.dtype, self.device) for op in region.ops]
        self._fns = [fn or callable_for(op.target) for fn, op in zip(integer, region.ops)]
        blank = {op.name for op in region.ops if zeroed and op.target in UNINITIALIZED}
        for i, op in enumerate(region.ops):
            if op.name in blank:
                self._fns[i] = _zeroed(self._fns[i])
        self._outs = {o: out_overload(region.op(o).target) for o in region.outputs
                      if o not in region.inplace and o not in blank
                      and integer_product(region.op(o).target, region.op(o).dtype,
                                          self.device) is None}
        self._last = (None, None)  # run()'s binding: (sizes, bound ops)

    def _binder(self, a, env):
        """_CONSTANT if `a` is the same on every call at the sizes `env`, else a function
        local -> it."""
        if isinstance(a, Ref):
            name = a.name
            return lambda local: local[name]
        if isinstance(a, list | tuple):
            parts = [self._binder(x, env) for x in a]
            if all(p is _CONSTANT for p in parts):
                return _CONSTANT
            fns = [_constant(self._fixed(x, env)) if p is _CONSTANT else p
                   for p, x in zip(parts, a)]
            kind = type(a)
            return lambda local: kind(f(local) for f in fns)
        return _CONSTANT

    def _fixed(self, a, env):
        """An argument's value at the sizes `env` (a device is this kernel's)."""
        if isinstance(a, torch.device):
            return self.device
        if isinstance(a, Sym):
            return a.expr if isinstance(a.expr, int) else compile_expr(a.expr)(env)
        if isinstance(a, list | tuple):
            return type(a)(self._fixed(x, env) for x in a)
        return a

    def _step(self, i: int, op: Op, env):
        """(name, fn, fixed args, [(position, binder)], fixed kwargs, [(name, binder)],
        mode, the op itself for when its `out=` form has no planned buffer to write)."""
        args, slots = [], []
        for j, a in enumerate(op.args):
            b = self._binder(a, env)
            args.append(self._fixed(a, env) if b is _CONSTANT else None)
            if b is not _CONSTANT:
                slots.append((j, _contiguous(b) if j in CONTIGUOUS_ARGS.get(op.target, ())
                              else b))
        kwargs, kslots = {}, []
        for k, v in op.kwargs.items():
            b = self._binder(v, env)
            if b is _CONSTANT:
                kwargs[k] = self._fixed(v, env)
            else:
                kslots.append((k, b))
        plain = entry_point(self._fns[i])
        if op.name in self.region.inplace:
            fn, mode = resolve(INPLACE_OF[op.target]), "inplace"
        elif self._outs.get(op.name) is not None:
            fn = self._outs[op.name]
            mode = "out" if op.target in KEEPS_OUT_STRIDES else "out_checked"
        elif (op.target in MEMO_VIEWS and [j for j, _ in slots] == [0] and not kslots
              and isinstance(op.args[0], Ref) and op.args[0].name in self.region.inputs):
            fn, mode = plain, "view"
        else:
            fn, mode = plain, "call"
        return op.name, fn, args, slots, kwargs, kslots, mode, plain, [None, None, None]

    def bind(self, env: dict[str, int], fixed: dict | None = None,
             device: torch.device | None = None) -> BoundOps:
        """The region's ops with their arguments bound at the sizes `env`: call the result
        with every value by name (and a stream, unused: ATen launches on the current
        one)."""
        return BoundOps(self.region, [self._step(i, op, env)
                                      for i, op in enumerate(self.region.ops)])

    def run(self, inputs: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
            env: dict[str, int]) -> None:
        key = tuple(sorted(env.items()))
        if self._last[0] != key:
            self._last = (key, self.bind(env))
        self._last[1]({**inputs, **outs}, 0)

    def describe(self) -> str:
        return f"torch ops on {self.device.type}:\n" + print_region(self.region, "  ")

    def to_json(self) -> dict:
        return {"kind": self.kind}


# ATen's messages for an index value outside its dim (embedding, index_select, index,
# gather, scatter, index_put/copy/add), not for a bad dim ("Dimension out of range").
_BAD_INDEX = re.compile(r"\bindex (-?\d+ )?(is )?out of (range|bounds)\b")


def is_bad_index(e: Exception) -> bool:
    """Whether ATen's error says an index value lay outside its dim."""
    return _BAD_INDEX.search(str(e)) is not None


def index_error(op: Op, e: Exception) -> IndexOutOfRangeError:
    """The user's data indexed past a dim: say so at the model's line, not as a raw
    IndexError from inside kiln."""
    return IndexOutOfRangeError(
        f"{op.target} was given an index outside the dim it indexes: {e}",
        where=op.where or op.name,
        hint="index values must lie in [-size, size) of the indexed dim (token ids below "
        "the vocabulary size); eager PyTorch refuses them too. State the module updates "
        "in place may be partly written by this call")
