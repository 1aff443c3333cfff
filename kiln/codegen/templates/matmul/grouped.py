"""The grouped GEMV: sibling products of one input (HF Llama's q, k, v) in one launch.

dispatch/group_siblings.py puts decode GEMVs that read the same input into one region
with an output per sibling; each costs 4-5 us over its bytes as a kernel of its own
(start latency, split merge, epilogue), so one launch for all saves that per sibling.
The weights stay the user's separate tensors (no concatenated copy): the grid's
column blocks run over the siblings' N ranges one after another, and each program
picks its sibling's weight pointer and N once, before its K loop (`tl.where` on
scalars: the loop's loads are the plain GEMV's, unconditional, so Triton still
pipelines them). The input's rows (an RMSNorm folded in: its sums of squares) are
read once per program as in the plain GEMV; K may be split as there (a split part's
scratch slot is its program's global column block). After the loop each sibling's
bias and epilogue run in a branch of their own and store its output.

Requires the siblings' weights to be read by the same index expression from their
own base (a [N_i, K] parameter read through its transpose: n * K + k, whatever N_i;
a [1, K] one, read at a constant column, may take the others' expression, which reads
the same elements at its only column), the same rows and a product that is the
output's shape (no broadcasting epilogue); anything else raises CodegenUnsupported, and
select_kernels splits the siblings apart again (dispatch/split.split_siblings).
"""

from __future__ import annotations

import re
from contextlib import contextmanager

from kiln.codegen.build.spec import KernelSpec
from kiln.codegen.expr.emit import indent
from kiln.codegen.expr.indexing import Lin, Var, linearize
from kiln.codegen.expr.values import CodegenUnsupported, Cond
from kiln.codegen.templates.matmul import template as plain
from kiln.dispatch.rmsnorm_prologue import closure
from kiln.ir.plan import DispatchPlan, Region
from kiln.ir.symbolic import same_dim
from kiln.target import Target

_WEIGHT = "wb"  # the program's sibling's weight pointer
_COLUMN = "rb2"  # the weight tile's column variable (the plain GEMV's)


def generate(region: Region, plan: DispatchPlan, target: Target) -> KernelSpec:
    """The region's matmul kernel: the grouped GEMV for sibling products with outputs of
    their own, else the matmul template's (one product, or paired siblings)."""
    mats = plain.products(region)
    if len(mats) == 1 or len(region.outputs) == 1:
        return plain.generate(region, plan, target)
    ops = {o.name: o for o in region.ops}
    owned = []
    for out in region.outputs:
        inside = closure(ops, out)
        mine = [m for m in mats if m.name in inside]
        if len(mine) != 1:
            raise CodegenUnsupported(f"grouped siblings' output %{out} reads {len(mine)} "
                                     "products")
        owned.append(mine[0])
    if len(set(m.name for m in owned)) != len(owned):
        raise CodegenUnsupported("two grouped siblings' outputs read one product")
    shapes = [plain.analyse(region, plan, m, [x for x in mats if x is not m]) for m in owned]
    return _GroupedGemv(region, plan, target, list(zip(owned, region.outputs, shapes))).spec()


class _GroupedGemv(plain._MatmulSource):
    """The first sibling's source, writing the others' (`self.siblings`, sharing its
    arguments and emitter) into the same kernel."""

    def __init__(self, region, plan, target, parts):
        (anchor, output, shape), *rest = parts
        super().__init__(region, plan, target, shape, anchor=anchor, output=output)
        self.siblings = [self] + [
            plain._MatmulSource(region, plan, target, sh, anchor=a, output=o, shared=self)
            for a, o, sh in rest]
        for sib in self.siblings:
            sh = sib.s
            if not sib.gemv or sh.batched:
                raise CodegenUnsupported("grouped siblings need the GEMV form")
            if not (same_dim(sib.rows, shape.m) and same_dim(sh.m, shape.m)
                    and same_dim(sib.cols, sh.n)):
                raise CodegenUnsupported("a grouped sibling's epilogue broadcasts its product")
            if not same_dim(sh.k, shape.k) or sh.dtype != shape.dtype or (
                    (sh.norm is None) != (shape.norm is None)):
                raise CodegenUnsupported("grouped siblings of different K, dtype or norm")

    def _gemv_tiles(self) -> tuple:
        cols = sum(sib.cols for sib in self.siblings)
        return cols, "(" + " + ".join(f"cdiv({self.p.grid(sib.cols)}, BLOCK_N)"
                                      for sib in self.siblings) + ")"

    def _columns(self) -> tuple[list[str], str, str]:
        """`sib`, the program's sibling; `nj` its N; `pid_n` its column block; `wb` its
        weight: scalars chosen once, from the running ends of the siblings' blocks."""
        p, sibs = self.p, self.siblings
        lines, ends = [], []
        for j, sib in enumerate(sibs):
            prev = ends[-1] if ends else "0"
            lines.append(f"end{j} = {prev} + tl.cdiv({p.dim(sib.cols)}, BLOCK_N)")
            ends.append(f"end{j}")
        last = len(sibs) - 1
        lines += [f"sib = {last}", f"nj = {p.dim(sibs[last].cols)}",
                  f"start = {ends[last - 1] if last else '0'}",
                  f"{_WEIGHT} = {self._pointer(sibs[last])}"]
        for j in range(last - 1, -1, -1):
            here = f"pid < end{j}"
            lines += [f"sib = tl.where({here}, {j}, sib)",
                      f"nj = tl.where({here}, {p.dim(sibs[j].cols)}, nj)",
                      f"start = tl.where({here}, {ends[j - 1] if j else '0'}, start)",
                      f"{_WEIGHT} = tl.where({here}, {self._pointer(sibs[j])}, {_WEIGHT})"]
        return lines + ["pid_n = pid - start"], "nj", "nj"

    def _pointer(self, sib) -> str:
        b = self.plan.values[self._weight_value(sib)]
        return self.p.tensor(b.name, b.dtype, b.shape)

    def _weight_value(self, sib) -> str:
        """The region input `sib`'s right operand is a view of (group_siblings checked)."""
        name = sib.s.b
        ops = self.em.ops
        while name in ops:
            name = ops[name].refs()[0]
        return name

    def _weight_loads(self, kb_ok: Cond | None) -> list[str]:
        """Each sibling's weight tile written with its own pointer, which must then be the
        only difference: the loop reads `wb` with that code. A single-column sibling (a
        [1, K] weight: Qwen3-Next's shared expert gate beside its router) reads its
        column at a constant, so its text lacks the column term; it takes the others'
        text when that reads the same element at column 0 (its `rn % nj` is 0)."""
        em = self.em
        start, texts, offsets = em._n, [], []
        for sib in self.siblings:
            em._n = start  # the same temp names, so the texts compare
            with em.block(), _loads_recorded(em) as offs:
                lines = plain._MatmulSource._weight_loads(sib, kb_ok)
            ptr = re.escape(self._pointer(sib))
            texts.append([re.sub(rf"\b{ptr}\b", _WEIGHT, x) for x in lines])
            offsets.append(offs)
        wide = [j for j, sib in enumerate(self.siblings) if not same_dim(sib.s.n, 1)]
        ref = wide[0] if wide else 0
        for j in range(len(self.siblings)):
            if texts[j] == texts[ref]:
                continue
            if j in wide or _at_column_zero(offsets[ref]) != _at_column_zero(offsets[j]):
                raise CodegenUnsupported("the grouped siblings' weights are not read alike "
                                         "(the same index map from their own base)")
        return texts[ref]

    def _finish(self) -> list[str]:
        """Each sibling's bias, rounding and epilogue in a branch of its own."""
        lines = []
        for j, sib in enumerate(self.siblings):
            with self.em.block():
                try:
                    body = plain._MatmulSource._finish(sib)
                except plain._Shifted:
                    raise CodegenUnsupported("a grouped sibling's epilogue reads its "
                                             "product at shifted columns") from None
            lines += [f"if sib == {j}:", *indent(body)]
        return lines

    def spec(self) -> KernelSpec:
        spec = super().spec()
        spec.meta["siblings"] = [sib.anchor.name for sib in self.siblings]
        spec.meta["epilogue_loads"] = max(sib._epilogue_loads for sib in self.siblings)
        return spec


@contextmanager
def _loads_recorded(em):
    """The flat offset (a Lin) of each region input `em` loads meanwhile, in order."""
    offsets: list = []
    load = em.load

    def recorded(name, index, mask):
        offsets.append(linearize(tuple(Lin.of(i) for i in index), em.shape(name)))
        return load(name, index, mask)

    em.load = recorded
    try:
        yield offsets
    finally:
        del em.load  # the instance attribute: the method again


def _at_column_zero(offsets: list) -> list | None:
    """The offsets with the weight column's plain terms dropped (their value at column
    0); None when the column variable sits inside another term (a division, a modulo),
    whose value at 0 a comparison of terms cannot tell."""
    out = []
    for off in offsets:
        terms = [(a, c) for a, c in off.terms
                 if not (isinstance(a, Var) and a.name == _COLUMN)]
        if any(_COLUMN in a.var_names() for a, _ in terms):
            return None
        out.append((tuple(terms), off.const))
    return out
