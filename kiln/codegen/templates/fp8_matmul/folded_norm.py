"""An RMSNorm folded into the one-token fp8 GEMV (kiln.dispatch.fold_rmsnorm).

At decode each Llama layer's two norms are kernels of their own (~2 us each on an H200,
plus the graph's gap) before the fp8 projections that read them, and the GEMV reads all
of x's row anyway. As in the bf16 GEMV (templates/matmul), the norm is a row scale r
times x * w: the GEMV quantises x * w per 128-block (a block's scale follows its values,
so quantising r * x * w gives r times the same values and scales, up to rounding),
multiplies, sums x^2 beside the product, and scales each row's sums by
r = rsqrt(mean(x^2) + eps) once, after the K splits' parts are combined. It computes the
norm in fp32, where eager rounds y to x's dtype before quantising: within fp8's tolerance.
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.indexing import broadcast_index
from kiln.codegen.expr.values import CodegenUnsupported, Val, mask_of
from kiln.dispatch.rmsnorm_prologue import RowNorm, closure, match_row_norm, read_only_as_operand
from kiln.ir.ops import IDENTITY_OPS, SHAPE_ONLY_OPS
from kiln.ir.plan import Op, Ref, Region
from kiln.ir.symbolic import same_dim


def row_norm(region: Region, anchor: Op, k) -> RowNorm | None:
    """The RMSNorm of x's rows the region computes (folded in), None when it computes
    no reduction; CodegenUnsupported for any other reduction in an fp8 region."""
    ops = {o.name: o for o in region.ops}
    if not any(o.target in ("aten.mean.dim", "aten.mean.default") for o in region.ops):
        return None
    src = anchor.args[0]
    while isinstance(src, Ref) and src.name in ops and (
            ops[src.name].target in SHAPE_ONLY_OPS | IDENTITY_OPS):
        src = ops[src.name].args[0]
    norm = match_row_norm(ops, src.name) if isinstance(src, Ref) else None
    if (norm is None or not same_dim(norm.dim, k) or norm.dim == 1
            or not read_only_as_operand(region.ops, region.outputs, anchor, 0, norm.out,
                                        closure(ops, norm.out))):
        raise CodegenUnsupported("a reduction in an fp8 linear region that is not an "
                                 "RMSNorm of x's rows read only by the product")
    return norm


class FoldedNorm:
    """The emitter's override for the norm's value, and the GEMV's lines for its row
    scale. `mask` is set by the GEMV before each read of x."""

    def __init__(self, norm: RowNorm, em: Emitter):
        self.norm, self.em = norm, em
        self.mask = mask_of()
        self.x: Val | None = None  # x as the last read computed it (for the squares)
        em.overrides[norm.out] = self.at

    def at(self, index) -> Val:
        """x * factors (the norm's weight) at `index`, in fp32, without the row scale."""
        em, norm = self.em, self.norm
        x = em.value(norm.x, broadcast_index(index, em.shape(norm.out), em.shape(norm.x)),
                     self.mask)
        v = self.x = em.cast(x, torch.float32)
        for op, other in norm.factors(em.ops):
            f = em.cast(em.operand(op, other, index, self.mask), torch.float32)
            v = em.let(f"{v.code} * {f.code}", torch.float32, v.vars | f.vars)
        return v

    def squares(self, acc: str, tail: str | None, step: str) -> str:
        """The line adding this step's x^2, summed over each 128-block, to `acc`
        ([1, KB]); `tail` masks K past its end; `step` is the step's [1, KB, 128] shape."""
        if self.x is None or "kk" not in self.x.vars:
            raise CodegenUnsupported("the folded RMSNorm's x does not vary along K")
        x = f"tl.broadcast_to({self.x.code}, {step})"
        if tail:
            x = f"tl.where({tail}, {x}, 0.0)"
        return f"{acc} += tl.sum({x} * {x}, 2)"

    def scale(self, squares: str, accs: list[str]) -> list[str]:
        """Each row's sums times rsqrt(mean(x^2) + eps), `squares` holding each row's
        whole sum of x^2 at every column."""
        n = self.norm
        lines = [f"row_scale = tl.rsqrt({squares} / {n.dim} + {n.eps!r})"]
        return lines + [f"{a} = {a} * row_scale" for a in accs]
