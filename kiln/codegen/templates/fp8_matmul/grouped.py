"""Grouped fp8 sibling GEMVs: block-scaled linears of one input in one launch.

dispatch/group_fp8_siblings.py puts decode fp8 linears that read the same x into one
extern region; each costs a few microseconds over its bytes as a kernel of its own.
The kernel is the plain fp8 GEMV's (gemv.py: [BN, KB, 128] weight steps as 16-byte
loads, each token row of x quantised per 128-block in registers, per-block products
scaled by both scales in fp32), with the weights left as the user's tensors:

- siblings with outputs of their own (V3's q_a_proj and kv_a_proj_with_mqa; q, k, v):
  the grid's column blocks run over the siblings' N ranges one after another, and
  each program picks its sibling's N, weight and scale pointers once, before its K
  loop (`tl.where` on scalars: the loop's loads stay the plain GEMV's, 16-byte
  vectors). K may be split as there, a part's scratch slot being its program's
  global column block. After the loop each sibling's bias and store run in a branch
  of their own.
- paired siblings (SiLU(gate) * up: two products and the pointwise ops after them):
  a program streams both weights at the same columns, so x is loaded and quantised
  once a step for the two; after the loop (and the split combine, both tiles in one
  part) each product gets its bias and is rounded to its dtype as the op rounds it,
  and the pointwise ops run on the tile through the expression emitter. The products
  are never stored. A step holds half the blocks of the plain one (the same weight
  bytes a thread in flight).

Declines (CodegenUnsupported; select_kernels then splits the siblings apart) past
GEMV_MAX_M tokens, for siblings of different x, K, tokens or dtype, and for
pointwise ops that read a product elsewhere than at its own element or write other
than a product's shape.
"""

from __future__ import annotations

import dataclasses

import torch

from kiln.codegen.build.spec import KernelSpec
from kiln.codegen.expr.emit import Emitter, indent, kernel_name, module_source
from kiln.codegen.expr.indexing import Lin, Var, reshape_index
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import CodegenUnsupported, Cond, Val, mask_of
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.fp8_matmul import gemv, template
from kiln.codegen.templates.fp8_matmul.analysis import BLOCK, OP, Fp8Shape, analyse_op
from kiln.codegen.templates.fp8_matmul.common import fp8_type
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import bounds_of, numel, same_dim
from kiln.target import Target

TUNABLES = ["BM", "BN", "SPLIT_K", "KB"]


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The region's fp8 kernel: grouped or paired siblings here, else template.py's."""
    mats = [o for o in region.ops if o.target == OP]
    if len(mats) == 1:
        return template.generate(region, plan, target)
    shapes = [analyse_op(region, plan, m) for m in mats]
    first = shapes[0]
    for sh in shapes[1:]:
        if not (sh.x == first.x and sh.k == first.k and same_dim(sh.m, first.m)
                and sh.dtype == first.dtype):
            raise CodegenUnsupported("grouped fp8 siblings of different x, K, tokens or dtype")
    for sh in shapes:
        if sh.scale not in region.inputs:
            raise CodegenUnsupported("a weight scale computed in the region (the grouped "
                                     "kernel reads each sibling's stored scales)")
    fp8_type(target)  # declines before any code is emitted
    m_hi = bounds_of(first.m, plan.symbols).hi
    if m_hi is None or m_hi > gemv.GEMV_MAX_M:
        raise CodegenUnsupported(f"grouped fp8 siblings need the GEMV form (at most "
                                 f"{gemv.GEMV_MAX_M} tokens)")
    names = {sh.out for sh in shapes}
    if sorted(region.outputs) == sorted(names):
        return _Grouped(region, plan, target, shapes, m_hi).spec()
    if len(shapes) == 2 and not names & set(region.outputs):
        if first.n != shapes[1].n:
            raise CodegenUnsupported("paired fp8 siblings of different widths")
        return _Paired(region, plan, target, shapes, m_hi).spec()
    raise CodegenUnsupported("fp8 siblings that are neither each an output nor a pair "
                             "read by the region's pointwise ops")


def _v(name: str, size) -> Lin:
    return Lin.of(Var(name, size, True))


class _Source:
    """What both forms share: the arguments, the emitter, the spec around the body."""

    kind = "fp8_gemv"
    streams = 1

    def __init__(self, region, plan, target, shapes: list[Fp8Shape], m_hi: int):
        self.region, self.plan, self.target = region, plan, target
        self.shapes, self.m_hi, self.s = shapes, m_hi, shapes[0]
        self.p = SymbolicArgs(plan.symbols)
        self.em = Emitter(region, plan, self.p, target, overrides=self._overrides())
        for name in list(region.inputs) + list(region.outputs):
            self.p.check_extent(plan.values[name].numel)

    def _overrides(self) -> dict:
        return {}

    def _config_shape(self) -> Fp8Shape:
        return self.s

    def _column_blocks(self) -> str:
        return f"cdiv({self.s.n}, BN)"

    def _lines(self) -> list[str]:
        raise NotImplementedError

    def spec(self) -> KernelSpec:
        s, p, target = self.s, self.p, self.target
        lines = self._lines()
        name = kernel_name(self.kind, self.region)
        params = p.names() + [split.PARTS, split.COUNTS] + [f"{t}: tl.constexpr"
                                                           for t in TUNABLES]
        source = module_source(name, params, lines, self.em.helpers, target, p.describe())
        tiles = f"cdiv({p.grid(s.m)}, BM) * {self._column_blocks()}"
        steps = f"cdiv({s.k}, KB * {BLOCK})"
        n_split = split.count("SPLIT_K", tiles, gemv.SPLIT_FILL * target.multiprocessors,
                              steps)
        grid = (f"cdiv({p.grid(s.m)}, BM)", self._column_blocks(), n_split)
        shape = self._config_shape()
        configs = gemv.config_space(shape, self.m_hi, self.streams)
        default = gemv.heuristic(shape, target, self.m_hi, self.streams)
        if default not in configs:
            configs.insert(0, default)
        numel_ = "BM * BN" if self.streams == 1 else f"{self.streams} * BM * BN"
        meta = {"dtype": str(s.dtype).replace("torch.", ""), "m_hi": self.m_hi,
                "n": shape.n, "k": s.k, "form": "gemv", "streams": self.streams,
                "siblings": [sh.out for sh in self.shapes]}
        return KernelSpec(name, source, p.args(), TUNABLES, grid, configs, default,
                          "fp8_matmul", meta, 64 if p.needs_int64 else 32,
                          scratch=split.scratch(tiles, n_split, numel_))

    def _pointers(self, sh: Fp8Shape) -> tuple[str, str]:
        p = self.p
        return (p.tensor(sh.weight, torch.float8_e4m3fn, (sh.n, sh.k)),
                p.tensor(sh.scale, torch.float32, (-(-sh.n // BLOCK), sh.k_blocks)))


class _Grouped(_Source):
    """Siblings each with its output: programs over the siblings' column ranges."""

    kind = "fp8_gemv_group"

    def _config_shape(self) -> Fp8Shape:
        return dataclasses.replace(self.s, n=sum(sh.n for sh in self.shapes))

    def _column_blocks(self) -> str:
        return "(" + " + ".join(f"cdiv({sh.n}, BN)" for sh in self.shapes) + ")"

    def _columns(self) -> list[str]:
        """`sib`, the program's sibling; its `N`, scale rows `NB`, weight `wb` and scales
        `sb`; `pid_n`, its column block: scalars chosen once, from the running ends
        of the siblings' blocks."""
        wide = ".to(tl.int64)" if self.p.needs_int64 else ""
        lines, ends = [f"pid = tl.program_id(1){wide}"], []
        for j, sh in enumerate(self.shapes):
            lines.append(f"end{j} = {ends[-1] + ' + ' if ends else ''}tl.cdiv({sh.n}, BN)")
            ends.append(f"end{j}")

        def chosen(j: int) -> list[tuple[str, object]]:
            sh = self.shapes[j]
            w, sc = self._pointers(sh)
            return [("sib", j), ("N", sh.n), ("NB", -(-sh.n // BLOCK)),
                    ("start", ends[j - 1] if j else 0), ("wb", w), ("sb", sc)]

        last = len(self.shapes) - 1
        lines += [f"{name} = {v}" for name, v in chosen(last)]
        for j in range(last - 1, -1, -1):
            lines += [f"{name} = tl.where(pid < end{j}, {v}, {name})" for name, v in chosen(j)]
        return lines + ["pid_n = pid - start"]

    def _lines(self) -> list[str]:
        def weights(em):
            return [(gemv.weight_step("wb", self.p, self.s, self.target),
                     gemv.scale_step("sb", "NB", self.s))]

        lines = gemv.body(self.em, self.p, self.s, self.target, self.m_hi,
                          columns=self._columns(), weights=weights, tile_id="pid")
        for j, sh in enumerate(self.shapes):
            lines += [f"if sib == {j}:", *indent(template.epilogue(self.em, sh))]
        return lines


class _Paired(_Source):
    """Two siblings at the same columns, their products read by the pointwise ops."""

    kind = "fp8_gemv_pair"
    streams = 2

    def _overrides(self) -> dict:
        self.products: dict[str, Val] = {}  # set after the loop, before the ops run
        return {sh.out: self._product_at(sh) for sh in self.shapes}

    def _tile_index(self, shape) -> tuple:
        s = self.s
        return reshape_index((_v("om", s.m), _v("on", s.n)), (s.m, s.n), tuple(shape))

    def _product_at(self, sh: Fp8Shape):
        own = self._tile_index(sh.out_shape)

        def at(index):
            if all(d == 1 or Lin.of(a).equals(b) for a, b, d in zip(index, own, sh.out_shape)):
                return self.products[sh.out]
            return None  # read elsewhere than at its own element: not this kernel's
        return at

    def _lines(self) -> list[str]:
        def weights(em):
            out = []
            for sh in self.shapes:
                w, sc = self._pointers(sh)
                out.append((gemv.weight_step(w, self.p, sh, self.target),
                            gemv.scale_step(sc, str(-(-sh.n // BLOCK)), sh)))
            return out

        em, s = self.em, self.s
        lines = gemv.body(em, self.p, s, self.target, self.m_hi, weights=weights)
        mask = mask_of(Cond("m_ok", frozenset({"om"})), Cond("n_ok", frozenset({"on"})))
        with em.block() as tail:
            for j, sh in enumerate(self.shapes):
                acc = gemv.tile(j)
                if sh.bias is not None:
                    b = em.value(sh.bias, (_v("on", sh.n),), mask_of(Cond("n_ok",
                                                                         frozenset({"on"}))))
                    tail.append(f"{acc} += {b.code}.to(tl.float32)")
                # the product in its own dtype, rounded as the op rounds its output
                self.products[sh.out] = em.cast(Val(acc, torch.float32,
                                                    frozenset({"om", "on"})), sh.dtype)
            for out in self.region.outputs:
                shape = tuple(self.plan.values[out].shape)
                if not same_dim(numel(shape), numel((s.m, s.n))):
                    raise CodegenUnsupported(f"a pointwise output %{out} {list(shape)} not "
                                             f"of the products' shape")
                idx = self._tile_index(shape)
                em.store(out, idx, em.value(out, idx, mask), mask, span=("om", "on"))
        return lines + tail
