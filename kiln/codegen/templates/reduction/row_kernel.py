"""Reduction regions as row kernels over (outer, reduced).

The reduced input's dims split into outer dims (one row each; XBLOCK rows per program)
and reduced dims (the row's elements, flattened); any axis or set of axes works, a
non-innermost reduction simply reads its rows with a stride. Forms (row_forms.py says
when each applies):

- persistent, when the row's upper bound is small enough (from the bounds analysis):
  the whole row is one RBLOCK tile held in registers, read once, however many
  reductions and per-element outputs the region has (softmax's max, sum and divide);
- looped, otherwise: each stage of reductions sweeps the row in RBLOCK chunks with
  masks, and per-element outputs that need the row's statistics (RMSNorm's multiply,
  softmax's divide) take one more sweep. Sweeps alternate direction, so each starts on
  the chunks the previous one read last, which are the likeliest still in L2;
- split, a looped form for few rows of fp32 sums and means: grid axis 1 divides each
  row among programs, which add their partial sums atomically into the zeroed output.

Reductions that depend on earlier ones (softmax's sum needs its max; var needs the
mean) run in later stages. Row values are handed to the emitter as overrides that
answer only for the current row, so a region that reads another row's statistic is
unsupported rather than wrong.
"""

from __future__ import annotations

import torch
import triton

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, indent, kernel_name, module_source, needs_int64
from kiln.codegen.expr.indexing import Lin, Var, delinearize, linearize
from kiln.codegen.expr.kernel_args import KernelArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, Val, mask_of, opmath
from kiln.codegen.templates.reduction.accumulate import Accumulators
from kiln.codegen.templates.reduction.forms import (
    SPLIT_OUTER_MAX,
    persistent_limit,
    reduction_configs,
    split_grid,
)
from kiln.codegen.templates.reduction.reduce_ops import OpPlan, plan_op
from kiln.ir.ops import OpCategory, category, reduction_dims
from kiln.ir.plan import DispatchPlan, Op, Ref, Region
from kiln.ir.symbolic import bounds_of, numel, same_dim, upper_bound
from kiln.target import Target

# Sums and means whose partial results may be added atomically (the split form).
_SPLITTABLE = {"aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim",
               "aten.mean.default"}


def generate_reduction(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The region as a row kernel; raises CodegenUnsupported saying why it declines."""
    return RowKernel(region, plan, target).spec()


def _is_reduction(op: Op) -> bool:
    return category(op.target) == OpCategory.REDUCTION


class RowKernel:
    def __init__(self, region: Region, plan: DispatchPlan, target: Target):
        self.region, self.plan, self.target = region, plan, target
        self.args = KernelArgs()
        self.em = Emitter(region, plan, self.args, target)
        self.reds = [op for op in region.ops if _is_reduction(op)]
        if not self.reds:
            raise CodegenUnsupported("a reduction region without a reduction")
        first = self.reds[0]
        self.src_shape = self._shape(first.args[0])
        self.dims = reduction_dims(first.target, first.args, first.kwargs, len(self.src_shape))
        for r in self.reds[1:]:
            shape = self._shape(r.args[0])
            dims = reduction_dims(r.target, r.args, r.kwargs, len(shape))
            if dims != self.dims or len(shape) != len(self.src_shape) or not all(
                    same_dim(a, b) for a, b in zip(shape, self.src_shape)):
                raise CodegenUnsupported("reductions over different rows in one region")
        S = self.src_shape
        self.outer_dims = [d for d in range(len(S)) if d not in self.dims]
        self.outer = numel([S[d] for d in self.outer_dims])
        self.rnumel = numel([S[d] for d in self.dims])
        self.rbound = upper_bound(self.rnumel, plan.symbols)
        self.static = isinstance(self.rnumel, int)
        self.innermost = bool(S) and max(self.dims) == len(S) - 1
        limit = persistent_limit(target, self.static, self.innermost, self._elem_bytes())
        self.persistent = self.rbound is not None and self.rbound <= limit
        self.split = not self.persistent and self._splittable()
        self.wide = needs_int64(region, plan)
        self.x = Var("xindex", self.outer)
        self.r = Var("rindex", self.rnumel)
        self.xmask = Cond("xmask", frozenset({"xindex"}))
        self.rmask = Cond("rmask", frozenset({"rindex"}))
        self.outer_index = delinearize(self.x, [S[d] for d in self.outer_dims])
        self.red_index = delinearize(self.r, [S[d] for d in self.dims])
        self.current_mask: frozenset = frozenset()
        # argmax positions fit int32 unless a row may not
        index_dtype = torch.int64 if self.wide else torch.int32
        self.acc = Accumulators(self.em, self.full_index, index_dtype)
        self._sweeps = 0

    def _elem_bytes(self) -> int:
        """The widest value computed per element (for how long a row registers hold):
        the input's, or the accumulator's (an int64 sum); argmax positions are int32."""
        dts = [self.em.dtype(r.args[0].name) for r in self.reds]
        dts += [r.dtype for r in self.reds if r.dtype is not None and (
            r.dtype.is_floating_point or r.target.startswith(("aten.sum", "aten.prod")))]
        return max(opmath(dt).itemsize for dt in dts)

    def _splittable(self) -> bool:
        """May rows be split among programs, partial results added atomically? Only
        fp32 sums and means that are the region's only outputs, none written in place,
        and only when the outer count can be small enough to leave the GPU idle."""
        outs = set(self.region.outputs)
        if self.region.inplace or not outs or any(
                r.target not in _SPLITTABLE or r.dtype != torch.float32 for r in self.reds):
            return False
        if not outs <= {r.name for r in self.reds}:
            return False
        return bounds_of(self.outer, self.plan.symbols).lo < SPLIT_OUTER_MAX

    def _shape(self, ref) -> tuple:
        if not isinstance(ref, Ref):
            raise CodegenUnsupported("reduction of a non-tensor")
        return tuple(self.em.shape(ref.name))

    # indices ------------------------------------------------------------------------
    def full_index(self) -> tuple:
        out, o, r = [], iter(self.outer_index), iter(self.red_index)
        for d in range(len(self.src_shape)):
            out.append(next(r) if d in self.dims else next(o))
        return tuple(out)

    def row_index(self, shape) -> tuple | None:
        """This row's index in a row-shaped value (keepdim or not), or None."""
        S = self.src_shape
        keep = [1 if d in self.dims else S[d] for d in range(len(S))]
        drop = [S[d] for d in self.outer_dims]
        if _same_shape(shape, keep):
            oi = iter(self.outer_index)
            return tuple(Lin() if d in self.dims else next(oi) for d in range(len(S)))
        if _same_shape(shape, drop):
            return tuple(self.outer_index)
        return None

    def _matches_row(self, index: tuple, shape) -> bool:
        want = self.row_index(shape)
        return want is not None and all(a.equals(b) for a, b in zip(index, want))

    def _matches_elem(self, index: tuple) -> bool:
        full = self.full_index()
        return all(index[d].equals(full[d]) for d in self.outer_dims)

    # planning -----------------------------------------------------------------------
    def _getitems(self) -> dict[str, list[tuple[int, str]]]:
        out: dict[str, list[tuple[int, str]]] = {}
        for op in self.region.ops:
            if op.target == "getitem" and isinstance(op.args[0], Ref):
                out.setdefault(op.args[0].name, []).append((op.args[1], op.name))
        return out

    def _levels(self, plans: dict[str, OpPlan]) -> dict[str, int]:
        """The stage index at which each reduction op's first stage runs."""
        ops = {o.name: o for o in self.region.ops}
        owner = {name: p.op.name for p in plans.values() for name in (*p.rows, *p.elems)}
        first: dict[str, int] = {}

        def deps(name: str, seen: set) -> set[str]:
            if name in seen or name not in ops:
                return set()
            seen.add(name)
            if name in owner and owner[name] != name:
                return {owner[name]}
            if name in plans:
                return {name}
            found: set[str] = set()
            for ref in ops[name].refs():
                found |= deps(ref, seen)
            return found

        for op in self.reds:
            inputs = set()
            for ref in op.refs():
                inputs |= deps(ref, set())
            first[op.name] = max((first[d] + len(plans[d].stages) for d in inputs), default=0)
        return first

    def _register(self, p: OpPlan) -> None:
        for name, fn in p.rows.items():
            shape = self.em.shape(name)
            box: list[Val] = []
            p_row = (name, fn, box)
            self._row_values.append(p_row)
            self.em.overrides[name] = (lambda idx, shape=shape, box=box:
                                       box[0] if box and self._matches_row(idx, shape) else None)
        for name, fn in p.elems.items():
            self.em.overrides[name] = (lambda idx, fn=fn:
                                       fn(idx, self.current_mask) if self._matches_elem(idx)
                                       else None)

    # emission -----------------------------------------------------------------------
    def _stages(self):
        """Each reduction's plan (its values registered with the emitter), the stages by
        level, and the level of each reduction's last stage."""
        n_code = self.em.dim(self.rnumel)
        getitems = self._getitems()
        plans = {op.name: plan_op(op, self.em, n_code, getitems, online=not self.persistent)
                 for op in self.reds}
        self._row_values: list = []
        for p in plans.values():
            self._register(p)
        first = self._levels(plans)
        by_stage: dict[int, list] = {}
        for name, p in plans.items():
            for k, stage in enumerate(p.stages):
                by_stage.setdefault(first[name] + k, []).append(stage)
        last_stage = {name: first[name] + len(p.stages) - 1 for name, p in plans.items()}
        return plans, by_stage, last_stage

    def _held(self, plans, by_stage, last_stage) -> None:
        """The stages over rows held whole in registers (the persistent form)."""
        done_after: set[int] = set()
        for level in sorted(by_stage):
            self.acc.reduce_tiles([a for stage in by_stage[level] for a in stage.accs],
                                  self.current_mask)
            self._finish_stages(level, by_stage, plans, last_stage, done_after)

    def held_rows(self, mask) -> None:
        """Every reduction of the region over rows another kernel holds whole in
        registers, as [XBLOCK, RBLOCK] tiles indexed by `xindex` and `rindex` (`mask`:
        its live lanes); afterwards the emitter answers the reductions' row and element
        values. A topk's prologue (a router's softmax) is computed so."""
        if not self.persistent:
            raise CodegenUnsupported("reductions over rows too long to hold in registers")
        plans, by_stage, last_stage = self._stages()
        self.current_mask = mask
        self._held(plans, by_stage, last_stage)

    def spec(self) -> KernelSpec:
        em = self.em
        n_code = em.dim(self.rnumel)
        plans, by_stage, last_stage = self._stages()
        elem_outs, row_outs = self._classify_outputs()
        outer_code, r_code = em.dim(self.outer), n_code
        pid = "tl.program_id(0).to(tl.int64)" if self.wide else "tl.program_id(0)"
        head = [f"xoffset = {pid} * XBLOCK",
                "xindex = xoffset + tl.arange(0, XBLOCK)[:, None]",
                f"xmask = xindex < {outer_code}"]
        if self.split:  # this program's chunks: whole RBLOCKs, so loads stay aligned
            head += [f"rsplit = tl.program_id(1){'.to(tl.int64)' if self.wide else ''}",
                     "nsplit = tl.num_programs(1)",
                     f"rchunk = (({r_code}) + nsplit - 1) // nsplit",
                     "rchunk = (rchunk + RBLOCK - 1) // RBLOCK * RBLOCK",
                     "rstart = rsplit * rchunk",
                     f"rstop = tl.minimum(rstart + rchunk, {r_code})"]
        em.lines.extend(head)
        done_after: set[int] = set()
        if self.persistent:
            static_full = isinstance(self.rnumel, int) and \
                self.rnumel == triton.next_power_of_2(self.rnumel)
            em.lines.append("rindex = tl.arange(0, RBLOCK)[None, :]")
            rcond = None if static_full else self.rmask
            if rcond is not None:
                em.lines.append(f"rmask = rindex < {r_code}")
            self.current_mask = mask_of(self.xmask, rcond)
            self._held(plans, by_stage, last_stage)
            self._store_elems(elem_outs)
        else:
            self.current_mask = mask_of(self.xmask, self.rmask)
            for level in sorted(by_stage):
                accs = [a for stage in by_stage[level] for a in stage.accs]
                for acc in accs:
                    self.acc.init(acc)
                with em.block() as body:
                    for acc in accs:
                        self.acc.update(acc, self.current_mask)
                self._sweep(body)
                for acc in accs:
                    self.acc.finish(acc)
                self._finish_stages(level, by_stage, plans, last_stage, done_after)
            if elem_outs:
                self._preemit_row_ops()
                with em.block() as body:
                    self._store_elems(elem_outs)
                self._sweep(body)
        for o, idx in row_outs:
            v = em.value(o, idx, mask_of(self.xmask))
            em.store(o, idx, v, mask_of(self.xmask), like="xindex", atomic_add=self.split)
        return self._assemble()

    def _sweep(self, body: list[str]) -> None:
        """Place `body` in a loop over the row's chunks. Every other sweep runs backwards:
        it starts on the chunks the sweep before it read last, the likeliest in L2."""
        em, r_code = self.em, self.em.dim(self.rnumel)
        backwards = self._sweeps % 2 == 1
        self._sweeps += 1
        head = []
        stages = "num_stages=RSTAGES"  # loads run RSTAGES - 1 chunks ahead (cp.async)
        if self.split:  # one sweep only: the split form has no later stage
            em.lines.append(f"for roffset in tl.range(rstart, rstop, RBLOCK, {stages}):")
        elif backwards:
            em.lines.append(f"for rstep in tl.range(0, ({r_code} + RBLOCK - 1) // RBLOCK, "
                            f"{stages}):")
            head.append(f"roffset = ({r_code} + RBLOCK - 1) // RBLOCK * RBLOCK - RBLOCK"
                        " - rstep * RBLOCK")
        else:
            em.lines.append(f"for roffset in tl.range(0, {r_code}, RBLOCK, {stages}):")
        head += ["rindex = roffset + tl.arange(0, RBLOCK)[None, :]", f"rmask = rindex < {r_code}"]
        em.lines.extend(indent(head + body))

    def _finish_stages(self, level, by_stage, plans, last_stage, done_after) -> None:
        for stage in by_stage[level]:
            if stage.after is not None and id(stage) not in done_after:
                done_after.add(id(stage))
                stage.after()
        for name, lvl in last_stage.items():
            if lvl == level:
                for row_name, fn, box in self._row_values:
                    if row_name in plans[name].rows and not box:
                        box.append(fn())

    def _classify_outputs(self):
        elem, row = [], []
        S = self.src_shape
        full = self.full_index()
        for o in self.region.outputs:
            shape = self.plan.values[o].shape
            if _same_shape(shape, S):
                elem.append((o, full))
            elif self.row_index(shape) is not None:
                row.append((o, self.row_index(shape)))
            elif same_dim(numel(shape), numel(S)):
                elem.append((o, delinearize(linearize(full, S), shape)))
            elif same_dim(numel(shape), self.outer):
                row.append((o, delinearize(self.x, shape)))
            else:
                raise CodegenUnsupported(f"output %{o} is neither per element nor per row")
        return elem, row

    def _store_elems(self, elem_outs) -> None:
        # size-1 dims are indexed at the constant 0: the pointer still spans the tile
        for o, idx in elem_outs:
            v = self.em.value(o, idx, self.current_mask)
            self.em.store(o, idx, v, self.current_mask, span=("xindex", "rindex"))

    def _preemit_row_ops(self) -> None:
        """Compute row-level ops (RMSNorm's rsqrt(mean + eps)) once, before the last sweep."""
        reduced = {o.name for o in self.reds}
        for op in self.region.ops:
            if op.shape is None or op.name in reduced or _is_reduction(op):
                continue
            idx = self.row_index(op.shape)
            if idx is None or not self._depends_on_reduction(op, reduced):
                continue
            try:
                self.em.value(op.name, idx, mask_of(self.xmask))
            except CodegenUnsupported:
                continue  # not a per-row value after all: computed per element instead

    def _depends_on_reduction(self, op: Op, reduced: set[str]) -> bool:
        ops = {o.name: o for o in self.region.ops}
        stack, seen = list(op.refs()), set()
        while stack:
            n = stack.pop()
            if n in reduced:
                return True
            if n in seen or n not in ops:
                continue
            seen.add(n)
            stack.extend(ops[n].refs())
        return False

    # the spec -----------------------------------------------------------------------
    def _assemble(self) -> KernelSpec:
        em, args = self.em, self.args
        kind = "reduction"
        name = kernel_name(kind, self.region)
        tunables = ["XBLOCK", "RBLOCK"] + ([] if self.persistent else ["RSTAGES"])
        params = args.names() + [f"{t}: tl.constexpr" for t in tunables]
        source = module_source(name, params, em.lines, em.helpers, self.target, args.describe())
        configs, default = self.configs()
        outer_code = args.dim(self.outer)
        grid = (f"cdiv({outer_code}, XBLOCK)",)
        if self.split:
            grid += (split_grid(outer_code, args.dim(self.rnumel)),)
        return KernelSpec(
            name, source, args.kernel_args(), tunables, grid, configs, default,
            kind, {"persistent": self.persistent, "form": self.form, "rnumel": str(self.rnumel),
                   "outer": str(self.outer), "dims": list(self.dims)},
            index_bits=64 if self.wide else 32,
            zero_outputs=list(self.region.outputs) if self.split else [])

    @property
    def form(self) -> str:
        return "persistent" if self.persistent else "split" if self.split else "looped"

    def configs(self) -> tuple[list[Config], Config]:
        loads = sum(self.em.dtype(v).itemsize for v in self.region.inputs)
        return reduction_configs(self.form, self.rbound,
                                 upper_bound(self.outer, self.plan.symbols), self.innermost,
                                 self.static, self.target, loads)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))
