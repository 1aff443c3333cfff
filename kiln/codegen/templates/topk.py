"""Topk regions: the k largest (or smallest) values of each row and their indices, as
one kernel whose prologue computes the row (a router's sigmoid and bias, a view into
expert groups, a mask of dropped groups, a router's softmax: reductions over the
topk's own rows, computed on the row it holds by the reduction template's code,
`RowKernel.held_rows`).

Why: on a GPU torch.topk of a short row is three kernels (gatherTopK, a bitonic sort of
the k picks, a copy), and its prologue one more; a DeepSeek-V3 router runs three
topks a layer. Routers' rows are short (8 to 512 experts) and k small (2 to 10), so
one program holds XBLOCK whole rows in registers and picks k times.

Each element becomes one int64 key: its value's order as a 32-bit integer in the high
half (a float's bits with the negatives' flipped, so integer order is float order;
every NaN above +inf, since torch counts NaN largest; all bits inverted for
largest=False) and W + 1 - its index in the low half (W: the row's length). Keys are
distinct, and the largest is the largest value at the lowest index among equal ones,
so one row max per pick gives both value and index; the picked key then becomes
SPENT, below every element's key (whose low half is at least 2). The k <= 32 picks
are unrolled.

What it returns, beside torch:
- values descending (ascending for largest=False), also for sorted=False (where any
  order is torch's);
- among equal values the lowest index first (torch leaves the order of ties
  unspecified; its CPU and CUDA orders differ); -0.0 counts below +0.0;
- NaN is larger than every number, as in torch: picked first for largest, last for
  smallest;
- indices int64, values in the input's dtype (exact: read back from the key).
Rows longer than TOPK_MAX_WIDTH, k over TOPK_MAX_K and 64-bit inputs decline (ir/ops.py):
the region runs as torch ops.

An epilogue (dispatch/fold_topk_sum.py): the picked values' sum over the topk's axis,
in fp32 from the values the program holds, and pointwise ops over the values' shape
reading them and the sum (a router's renormalisation), stored as further outputs.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton

from kiln.codegen.build.spec import Config, KernelSpec
from kiln.codegen.expr.emit import Emitter, kernel_name, module_source, needs_int64
from kiln.codegen.expr.indexing import Lin, Var, delinearize
from kiln.codegen.expr.kernel_args import KernelArgs
from kiln.codegen.expr.values import TL, CodegenUnsupported, Cond, Val, mask_of
from kiln.codegen.templates.reduction.row_kernel import RowKernel
from kiln.dispatch.fold_topk_sum import sums_picked_values
from kiln.ir.ops import OpCategory, category, topk_args, topk_problem
from kiln.ir.plan import DispatchPlan, Ref, Region
from kiln.ir.symbolic import numel, same_dim, upper_bound
from kiln.target import Target

OP = "aten.topk.default"
SPENT = -(2**63) + 1  # a picked key: below every element's (low half >= 2)
# int64 keys a thread may hold (two registers each) before a config spills
MAX_KEYS_PER_THREAD = 32
WARPS = (1, 2, 4, 8, 16)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The region as one topk kernel; raises CodegenUnsupported saying why it declines."""
    return _TopkKernel(region, plan, target).spec()


class _TopkKernel:
    def __init__(self, region: Region, plan: DispatchPlan, target: Target):
        self.region, self.plan, self.target = region, plan, target
        self.op = region.anchor()
        src = self.op.args[0]
        if not isinstance(src, Ref):
            raise CodegenUnsupported("topk of a non-tensor")
        self.rows = None  # reductions over the topk's rows in its prologue
        prologue = region.ops[:region.ops.index(self.op)]
        if any(category(o.target) == OpCategory.REDUCTION for o in prologue):
            # the row kernel sees the prologue's reductions, its emitter every op
            self.rows = RowKernel(replace(region, ops=prologue), plan, target)
            self.rows.em.ops = {o.name: o for o in region.ops}
            self.args, self.em = self.rows.args, self.rows.em
        else:
            self.args = KernelArgs()
            self.em = Emitter(region, plan, self.args, target)
        self.src = src.name
        self.shape = tuple(self.em.shape(src.name))
        self.dtype = self.em.dtype(src.name)
        if not self.shape:
            raise CodegenUnsupported("topk of a 0-d tensor")
        self.k, self.dim, self.largest = topk_args(self.op.target, self.op.args,
                                                   self.op.kwargs, len(self.shape))
        self.width = self.shape[self.dim]
        self.wbound = upper_bound(self.width, plan.symbols)
        problem = topk_problem(self.k, self.wbound, self.dtype)
        if problem is not None:
            raise CodegenUnsupported(f"kiln generates no topk where {problem}")
        if self.k < 1:
            raise CodegenUnsupported("a topk of no elements")
        self.outer_dims = [d for d in range(len(self.shape)) if d != self.dim]
        self.outer = numel([self.shape[d] for d in self.outer_dims])
        self.parts = self._parts()
        if self.rows is not None and (tuple(self.rows.dims) != (self.dim,) or not all(
                same_dim(a, b) for a, b in zip(self.rows.src_shape, self.shape))
                or len(self.rows.src_shape) != len(self.shape)):
            raise CodegenUnsupported("a reduction in a topk's prologue over other rows")

    def _parts(self) -> dict[str, int | str]:
        """Region output -> which of topk's results it is: 0 values, 1 indices, "sum"
        (the picked values summed over the topk's axis) or "epilogue" (a pointwise op
        over the values' shape after it: dispatch/fold_topk_sum.py)."""
        self.sums = [o for o in self.region.ops if sums_picked_values(o, self.region)]
        after = {o.name for o in self.region.ops[self.region.ops.index(self.op) + 1:]}
        parts = {}
        for o in self.region.outputs:
            g = self.region.op(o)
            if g.target == "getitem" and g.args[0] == Ref(self.op.name):
                parts[o] = g.args[1]
            elif any(g is x for x in self.sums):
                parts[o] = "sum"
            elif self.sums and o in after and \
                    category(g.target) == OpCategory.POINTWISE:
                parts[o] = "epilogue"
            else:
                raise CodegenUnsupported(f"output %{o} is not one of the topk's results")
        return parts

    def spec(self) -> KernelSpec:
        em, args = self.em, self.args
        wide = needs_int64(self.region, self.plan)
        rblock = triton.next_power_of_2(self.wbound)
        kblock = triton.next_power_of_2(self.k)
        x, r, kv = Var("xindex", self.outer), Var("rindex", self.width), Var("kindex", self.k)
        xmask = Cond("xmask", frozenset({"xindex"}))
        static_full = isinstance(self.width, int) and self.width == rblock
        rmask = None if static_full else Cond("rmask", frozenset({"rindex"}))
        kmask = None if kblock == self.k else Cond("kmask", frozenset({"kindex"}))
        outer_index = delinearize(x, [self.shape[d] for d in self.outer_dims])
        w = em.dim(self.width)
        pid = "tl.program_id(0).to(tl.int64)" if wide else "tl.program_id(0)"
        em.lines.extend([f"xoffset = {pid} * XBLOCK",
                         "xindex = xoffset + tl.arange(0, XBLOCK)[:, None]",
                         f"xmask = xindex < {em.dim(self.outer)}",
                         "rindex = tl.arange(0, RBLOCK)[None, :]",
                         f"kindex = tl.arange(0, {kblock})[None, :]"])
        if rmask is not None:
            em.lines.append(f"rmask = rindex < {w}")
        if kmask is not None:
            em.lines.append(f"kmask = kindex < {self.k}")
        if self.rows is not None:
            self.rows.held_rows(mask_of(xmask, rmask))
        v = em.value(self.src, _insert(outer_index, self.dim, r), mask_of(xmask, rmask))
        em.lines.extend(self._keys(v, w, rmask is not None))
        em.lines.extend(self._picks())
        outs = {"xindex", "kindex"}
        out_index = _insert(outer_index, self.dim, kv)
        values = Val("topk_values", self.dtype, frozenset(outs))
        if self.sums:
            self._epilogue(values, kmask is not None)
        for o, part in self.parts.items():
            if part == "sum":
                keep = len(self.region.op(o).shape) == len(self.shape)
                at = _insert(outer_index, self.dim, Lin.of(0)) if keep else tuple(outer_index)
                em.store(o, at, em.value(o, at), mask_of(xmask), span=("xindex",))
                continue
            val = values if part == 0 else Val("topk_indices", torch.int64, frozenset(outs))
            if part == "epilogue":
                val = em.value(o, out_index, mask_of(xmask, kmask))
            em.store(o, out_index, val, mask_of(xmask, kmask), span=("xindex", "kindex"))
        name = kernel_name("topk", self.region)
        params = args.names() + ["XBLOCK: tl.constexpr", "RBLOCK: tl.constexpr"]
        source = module_source(name, params, em.lines, em.helpers, self.target,
                               args.describe())
        configs, default = topk_configs(rblock, upper_bound(self.outer, self.plan.symbols),
                                        self.target)
        return KernelSpec(name, source, args.kernel_args(), ["XBLOCK", "RBLOCK"],
                          (f"cdiv({args.dim(self.outer)}, XBLOCK)",), configs, default, "topk",
                          {"k": self.k, "largest": self.largest, "width": str(self.width),
                           "outer": str(self.outer)},
                          index_bits=64 if wide else 32)

    def _epilogue(self, values: Val, kmasked: bool) -> None:
        """Make the sum of the picked values (fp32, as torch sums a float row) and the
        values themselves what the epilogue's ops read (the emitter's overrides)."""
        picked = "topk_values.to(tl.float32)"
        if kmasked:  # the pick slots past k hold no value
            picked = f"tl.where(kmask, {picked}, 0.0)"
        total = self.em.let(f"tl.sum({picked}, axis=1)[:, None]", torch.float32,
                            frozenset({"xindex"}))
        for op in self.sums:  # keepdim or not, in its own dtype: one sum of the picks
            cast = self.em.cast(total, op.dtype)
            self.em.overrides[op.name] = lambda index, cast=cast: cast
            self.em.overrides[op.args[0].name] = lambda index: values

    def _keys(self, v: Val, w: str, masked: bool) -> list[str]:
        """Lines making `topk_keys` [XBLOCK, RBLOCK] int64 from the row's values `v`."""
        if self.dtype.is_floating_point:
            f = self.em.tensor(self.em.cast(v, torch.float32)).code
            lines = [f"topk_bits = {f}.to(tl.int32, bitcast=True)",
                     "topk_order = topk_bits ^ ((topk_bits >> 31) & 0x7FFFFFFF)",
                     f"topk_order = tl.where({f} != {f}, 0x7FFFFFFF, topk_order)"]
        else:
            lines = [f"topk_order = {self.em.tensor(v).code}.to(tl.int32)"]
        if not self.largest:
            lines.append("topk_order = ~topk_order")
        lines.append(f"topk_keys = (topk_order.to(tl.int64) << 32) | "
                     f"({w} + 1 - rindex).to(tl.int64)")
        if masked:
            lines.append(f"topk_keys = tl.where(rmask, topk_keys, {SPENT})")
        return lines

    def _picks(self) -> list[str]:
        """Lines picking the k largest keys of each row into `topk_picks` [XBLOCK, KBLOCK],
        then reading `topk_values` and `topk_indices` back from them."""
        lines = ["topk_picks = tl.zeros([XBLOCK, kindex.shape[1]], dtype=tl.int64)",
                 f"for j in tl.static_range({self.k}):",
                 "    topk_best = tl.max(topk_keys, axis=1)[:, None]",
                 "    topk_picks = tl.where(kindex == j, topk_best, topk_picks)",
                 f"    topk_keys = tl.where(topk_keys == topk_best, {SPENT}, topk_keys)",
                 "topk_order = (topk_picks >> 32).to(tl.int32)"]
        if not self.largest:
            lines.append("topk_order = ~topk_order")
        if self.dtype.is_floating_point:
            lines += ["topk_bits = topk_order ^ ((topk_order >> 31) & 0x7FFFFFFF)",
                      "topk_values = topk_bits.to(tl.float32, bitcast=True)"]
            if self.dtype != torch.float32:  # exact: the value came from this dtype
                lines[-1] += f".to({TL[self.dtype]})"
        else:
            lines.append(f"topk_values = topk_order.to({TL[self.dtype]})")
        w = self.em.dim(self.width)
        lines.append(f"topk_indices = ({w} + 1 - topk_picks.to(tl.int32)).to(tl.int64)")
        return lines


def _insert(outer_index, dim: int, var: Var) -> tuple:
    """The full index: the outer dims' index with `var` at axis `dim`."""
    out = list(outer_index)
    out.insert(dim, var)
    return tuple(out)


def topk_configs(rblock: int, outer_bound: int | None, target: Target
                 ) -> tuple[list[Config], Config]:
    """XBLOCK rows x num_warps candidates holding at most MAX_KEYS_PER_THREAD keys a
    thread (every thread busy: at least one key each), and the heuristic default: about
    512 keys a program, a warp per 512 (16 keys a thread: a pick's max then stays within
    a warp's shuffles, with no barrier between warps), so a decode step's few rows
    spread over as many programs and a prefill's many share them."""
    xcap = min(triton.next_power_of_2(outer_bound) if outer_bound else 1024, 1024)
    max_warps = max(1, target.max_threads_per_block // target.warp_size)

    def ok(xb: int, warps: int) -> bool:
        per_thread = xb * rblock / (warps * target.warp_size)
        return warps <= max_warps and per_thread <= MAX_KEYS_PER_THREAD and (
            warps == 1 or per_thread >= 1)

    xb = max(1, min(xcap, 512 // rblock))
    warps = max(1, min(8, xb * rblock // 512))
    while not ok(xb, warps) and warps < max_warps:
        warps *= 2
    default = Config.make(warps, 1, XBLOCK=xb, RBLOCK=rblock)
    configs = [Config.make(w, 1, XBLOCK=x, RBLOCK=rblock)
               for x in (1 << i for i in range(11)) if x <= xcap
               for w in WARPS if ok(x, w)]
    return [default] + [c for c in configs if c != default], default
