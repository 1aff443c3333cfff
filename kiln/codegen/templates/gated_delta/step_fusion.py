"""What the decode kernel computes besides the recurrence: its fused prologue and the
state write it takes over (dispatch/fold_delta_step.py puts them into its region).

- Prologue ops are computed by the emitter where the kernel reads its operands: the
  causal convolution and its SiLU at the q, k and v elements a program reads, the gates
  from the b and a projections, the fresh-sequence `where` on the state. A reduction
  over one dim (an l2norm's sum of squares over a key head) is asked for at an index
  with no block variable, since each program reads whole q and k rows: `reductions`
  computes it as one vector over the reduced dim (the kernel's own key lanes when the
  size matches, so the conv is computed once), summed in registers. Asked for at any
  other index it declines, and the region's prologues are split out again.
- An epilogue reads o (a gated RMSNorm over each value head of it, then times SiLU of
  the z projection): it runs over a whole head's lanes `vh` and output `o_h` (the
  program's own o when its value block is the head, else the head read back by the
  last of its programs to finish: body.py), its mean of squares a reduction over those
  lanes; its result is stored where o would be.
- The final state may leave through an in-place `index_put` into the recurrent state
  (`state[torch.arange(B)] = final`): `state_store` finds that write and
  `store_final` stores each program's state block where the scatter would have put
  it. That is safe only because a program reads the old state at exactly the elements
  it writes, before writing them: `StateReads` records every read of the destination
  and `store_final` declines unless each read is at the written element.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.gather import advanced_index, indexed_shape
from kiln.codegen.expr.indexing import Lin, Var, linearize
from kiln.codegen.expr.values import TL, CodegenUnsupported, Cond, Val, mask_of, opmath
from kiln.ir.ops import RESHAPES, bind_args, reduction_dims
from kiln.ir.plan import Op, Ref, Region
from kiln.ir.symbolic import same_dim

SCATTER = "aten.index_put.default"
# reductions a program computes whole: op -> (Triton reduce, identity of masked lanes)
_REDUCE = {
    "aten.sum.dim_IntList": ("tl.sum", "0.0"),
    "aten.mean.dim": ("tl.sum", "0.0"),
    "aten.amax.default": ("tl.max", 'float("-inf")'),
    "aten.amin.default": ("tl.min", 'float("inf")'),
}


Lanes = dict[int, tuple[str, int, Cond]]


def reductions(em: Emitter, lanes: Lanes, ops: list[Op]) -> None:
    """Give `em` an override for every reduction op of `ops`. `lanes`: size ->
    (block variable, its padded width, the mask the kernel reads under) the kernel
    already has (the key lanes `kk` for the prologue, a whole value head's `vv` for the
    epilogue): reading the same lanes under the same mask finds the values the kernel
    computed for its operand, not a second copy."""
    for op in ops:
        if op.target in _REDUCE:
            em.overrides[op.name] = _reducer(em, op, lanes)


def split_ops(region: Region, anchor: str) -> tuple[list[Op], list[Op]]:
    """The region's ops before its anchor (the prologue) and after it (the epilogue)."""
    names = [o.name for o in region.ops]
    at = names.index(anchor)
    return region.ops[:at], region.ops[at + 1:]


def output_of_step(em: Emitter, name: str, at, o: Val):
    """An override giving the step's output `name` (o's getitem) as the kernel's `o`,
    at the program's own elements `at` only (the epilogue reads it nowhere else)."""
    shape = em.shape(name)

    def unit(index):  # size-1 dims read at 0 whatever their variable
        return tuple(Lin() if same_dim(n, 1) else Lin.of(i) for i, n in zip(index, shape))

    want = unit(at)

    def value(index) -> Val | None:
        if unit(index) != want:
            return None
        return em.cast(o, em.dtype(name))

    em.overrides[name] = value


def _reducer(em: Emitter, op: Op, lanes: Lanes):
    def at(index) -> Val | None:
        if any(Lin.of(i).var_names() for i in index):
            return None  # a reduction per lane of a tile: not what a program holds
        src = op.args[0]
        if not isinstance(src, Ref):
            return None
        shape = em.shape(src.name)
        dims = reduction_dims(op.target, op.args, op.kwargs, len(shape))
        if len(dims) != 1 or not isinstance(shape[dims[0]], int):
            return None
        d, n = dims[0], shape[dims[0]]
        var, width, ok = lanes.get(n) or (None, max(16, 1 << (n - 1).bit_length()), None)
        if var is None:
            var = em.let(f"tl.arange(0, {width})", torch.int64).code
            ok = Cond(f"{var} < {n}", frozenset({var}))
        r = Lin.of(Var(var, n))
        keep = bool(bind_args(op).get("keepdim", False))
        inner = index[:d] + (r,) + index[d + 1:] if keep else index[:d] + (r,) + index[d:]
        x = em.cast(em.value(src.name, inner, mask_of(ok)), opmath(op.dtype))
        reduce_fn, identity = _REDUCE[op.target]
        full = f"tl.where({ok.code}, tl.zeros([{width}], {TL[x.dtype]}) + {x.code}, {identity})"
        total = em.let(f"{reduce_fn}({full}, 0)", x.dtype)
        if op.target == "aten.mean.dim":
            total = em.let(f"{total.code} / {float(n)!r}", x.dtype)
        return em.cast(total, op.dtype)

    return at


@dataclass
class StateStore:
    """The in-place scatter writing the final state into state value `dest`."""

    op: str  # the index_put op (a region output written in place)
    dest: str  # the state value it writes


def state_store(region: Region, final: str) -> StateStore | None:
    """The region's in-place index_put that writes the final state (getitem `final`)
    whole, element for element (its value is `final` through reshapes only), or None."""
    ops = {o.name: o for o in region.ops}
    for out, dest in region.inplace.items():
        op = ops.get(out)
        if op is None or op.target != SCATTER:
            continue
        a = bind_args(op)
        if a.get("accumulate") or not isinstance(a["values"], Ref):
            continue
        name = a["values"].name
        while name != final and name in ops and ops[name].target in RESHAPES:
            name = ops[name].args[0].name
        if name == final:
            return StateStore(out, dest)
    return None


@dataclass
class StateReads:
    """Every element offset at which the kernel reads state value `name` (an override
    of the emitter's load that records it)."""

    name: str
    mask: frozenset
    offsets: list[Lin] = field(default_factory=list)

    def install(self, em: Emitter) -> None:
        shape = em.shape(self.name)

        def load(index) -> Val:
            index = tuple(Lin.of(i) for i in index)
            self.offsets.append(linearize(index, shape))
            return em.load(self.name, index, self.mask)

        em.overrides[self.name] = load


def store_final(em: Emitter, store: StateStore, final: str, at, S: Val, mask,
                reads: StateReads) -> None:
    """Store state block `S` (final state element `at`) where `store`'s scatter puts it."""
    op = em.ops[store.op]
    a = bind_args(op)
    dest_shape = em.shape(a["self"].name)
    update = indexed_shape(em, dest_shape, a["indices"])
    final_shape = em.shape(final)
    big = [i for i, n in zip(at, final_shape) if not same_dim(n, 1)]
    if [n for n in update if not same_dim(n, 1)] != [n for n in final_shape
                                                     if not same_dim(n, 1)]:
        raise CodegenUnsupported("the state write's update is not the final state's shape")
    u = tuple(Lin() if same_dim(n, 1) else big.pop(0) for n in update)
    dest = advanced_index(em, dest_shape, a["indices"], update, u, mask, what=op.target)
    written = linearize(tuple(Lin.of(i) for i in dest), dest_shape)
    if any(r != written for r in reads.offsets):
        raise CodegenUnsupported("the kernel reads the state it writes in place at other "
                                 "elements than it writes")
    em.store(store.op, dest, S, mask)
