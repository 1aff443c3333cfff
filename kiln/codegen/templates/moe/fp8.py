"""The grouped MoE kernel's fp8 form (kiln::moe_experts_fp8): its two K loops.

Everything else is the bf16 kernel's (body.py: routing, tiles, the h and output row
buffers, the fixed-order combine). Each K step is one 128-wide block (BK = 128, the
quantisation block), as kiln::fp8_linear's one-kernel form does
(templates/fp8_matmul/template.py):

- gate / up: the tile's gathered x rows [BM, 128] in x's dtype, quantised per row in
  registers to e4m3 with a scale each (common.quantise_rows: exactly the op's
  quantize_activations), times the expert's gate and up tiles [BN, 128] (e4m3, read
  once as stored), fp32 accumulation, each block's product times the row scales and
  the weight's block scale of its columns;
- down: the tile's h rows (stored in x's dtype, as fp8_linear's outputs are rounded)
  quantised again the same way, times the down tile [BD, 128] and its scales.

A gate/up tile of BN <= 128 columns lies in one 128-row weight block, but BD = 2 BN
columns of down may span two: each column reads its own block's scale. Expert
weights and scales are read directly (stored [E, out, in] and [E, out/128, in/128],
contiguous region inputs: analysis.py); masked fp8 loads fill with 0.0 (the
emitter's fill is the integer 0, which Triton cannot cast to fp8). gfx942 reads the
e4m3fn bytes as fnuz with doubled scales, the interpreter rounds on e4m3's grid
(fp8_matmul/common.py).
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.values import Val, mask_code, mask_of
from kiln.codegen.templates.fp8_matmul.common import (
    fnuz_scale,
    from_e4m3fn,
    quantise_rows,
)
from kiln.codegen.templates.moe.body import MoeBody, lin_var, tail_cond
from kiln.ops.fp8_linear import BLOCK


class Fp8MoeBody(MoeBody):
    """MoeBody with e4m3 experts: activations quantised per row and 128-block in the
    kernel, block scales applied per K step."""

    def lines(self) -> list[str]:
        return [f"tl.static_assert(BK == {BLOCK})  # a K step is one scale block",
                *super().lines()]

    def _weight(self, name: str, rows: str, n_rows: int, n_cols: int, mask) -> str:
        """Expert `e`'s e4m3 tile at rows `rows` [B, 1] and columns `ok` [1, BK]."""
        ptr = self.p.tensor(name, torch.float8_e4m3fn, (self.s.experts, n_rows, n_cols))
        code = mask_code(mask)
        masked = f", mask={code}, other=0.0" if code else ""
        tile = (f"tl.load({ptr} + e * {n_rows * n_cols} + {rows} * {n_cols} + ok"
                f"{masked})")
        return from_e4m3fn(tile, self.em.target)

    def _scale(self, name: str, cols: str, n_rows: int, n_cols: int) -> str:
        """Expert `e`'s block scales [1, B] of output columns `cols` at K block `kb`."""
        rb, cb = -(-n_rows // BLOCK), -(-n_cols // BLOCK)
        ptr = self.p.tensor(name, torch.float32, (self.s.experts, rb, cb))
        return (f"tl.load({ptr} + e * {rb * cb} + ({cols} // {BLOCK}) * {cb} + kb, "
                f"mask={cols} < {n_rows}, other=0.0){fnuz_scale(self.em.target)}")

    def _product(self, acc: str, weight: str, scale: str) -> str:
        xs = f"(xs{fnuz_scale(self.em.target)})[:, None]"
        return (f"{acc} += tl.dot(xq, tl.trans({weight}), out_dtype=tl.float32) * {xs} * "
                f"{scale}")

    def _rounded(self, v: str, lines: list[str]) -> str:
        """fp32 `v` rounded to x's dtype and back (the lines appended): where the op
        rounds, to nearest even on every target."""
        s, em = self.s, self.em
        if s.dtype == torch.float32:
            return v
        with em.block() as cast:
            low = em.cast(Val(f"({v})", torch.float32, frozenset({"om"})), s.dtype)
        lines += cast
        return f"{low.code}.to(tl.float32)"

    def _swiglu(self) -> list[str]:
        """As the op: g and u rounded to x's dtype (fp8_linear's outputs), silu(g)
        rounded, then the product (rounded when stored)."""
        L: list[str] = []
        L.append(f"g = {self._rounded('acc_g', L)}")
        L.append(f"sg = {self._rounded('g / (1.0 + tl.exp(-g))', L)}  # silu(g)")
        L.append(f"h = sg * {self._rounded('acc_u', L)}")
        return L

    def _weighted(self, weight: str) -> list[str]:
        """As the op: fp8_linear's output rounded to x's dtype, then weighted."""
        L: list[str] = []
        L.append(f"o = {self._rounded('acc', L)} * {weight}")
        return L

    def _gate_up_step(self) -> list[str]:
        s, em = self.s, self.em
        k_ok = tail_cond("ok", s.dim)
        x_mask = mask_of(self.r_ok, k_ok)
        w_mask = mask_of(tail_cond("wn", s.inter), k_ok)
        gs, us, _ = s.scales
        step = ["ok = k0 + tl.arange(0, BK)[None, :]", f"kb = k0 // {BLOCK}"]
        with em.block() as load:
            x = em.value(s.x, (self.tok, lin_var("ok", s.dim)), x_mask)
        step += load + [
            f"xf = tl.broadcast_to(tl.where({mask_code(x_mask)}, {x.code}.to(tl.float32), "
            "0.0), [BM, BK])",
            "# per row: this K block's scale, and the block quantised in registers",
            *quantise_rows("xf", em.target),
            f"gt = {self._weight(s.gate, 'wn', s.inter, s.dim, w_mask)}",
            f"ut = {self._weight(s.up, 'wn', s.inter, s.dim, w_mask)}",
            self._product("acc_g", "gt", self._scale(gs, "on", s.inter, s.dim)),
            self._product("acc_u", "ut", self._scale(us, "on", s.inter, s.dim)),
        ]
        return step

    def _down_step(self) -> list[str]:
        s = self.s
        w_mask = mask_of(tail_cond("wd", s.dim), tail_cond("ok", s.inter))
        return [
            *self._h_tile(), f"kb = k0 // {BLOCK}",
            "xf = ht.to(tl.float32)  # zeros past the tile's rows and I",
            *quantise_rows("xf", self.em.target),
            f"dt = {self._weight(s.down, 'wd', s.dim, s.inter, w_mask)}",
            self._product("acc", "dt", self._scale(s.scales[2], "od", s.dim, s.inter)),
        ]

