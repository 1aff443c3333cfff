"""The grouped fp8 MoE kernel's decode form: its two K loops as GEMVs on CUDA cores.

At decode (a batch of 1..GEMV_MAX_TOKENS tokens) an expert gets a row or a few, so the
launch is a copy of the chosen experts' weights with a little arithmetic. The tl.dot
form (fp8.py) pads a tile's rows to 16, and under 64 rows Triton's fp8 tl.dot is
mma.sync on fp16 operands: every e4m3 weight tile widened in registers, and each
128-wide K step waiting on the gathered x's and the scales' loads. On an H200, V3's
8 experts x (gate, up, down) of 2048 x 7168 for one token took 170 us, twice the
bytes' copy time. This is kiln::fp8_linear's GEMV form (fp8_matmul/gemv.py) in the
grouped kernel: a program streams steps of [BN, KB, 128] weight bytes as 16-byte
loads, quantises each of its tile's rows of x (or h) per 128-block in registers
exactly as the op does (common.quantise_rows) and accumulates (sum_k xq wq) * xs * ws
per (row, block column) in fp32, summed over the step's blocks after the loop. On
NVIDIA GPUs, where both K widths are whole 512-wide steps (V3's), the products are
fp8_linear's packed fp16 ones (fp8_matmul/packed_product.py: the weights read as 4-byte
words) and a step's weight and scale loads go out before any row's quantisation.

Everything else is the tl.dot form's (body.py, fp8.py): the routers, the tiles of BM
rows of one expert, all experts in one launch, gate and up in the same program (x
read and quantised once for both), silu(g) * u rounded where the op rounds and stored
to the h rows, the down programs waiting for their tile's h, and the fixed-order
combine. A tile's rows are unrolled (at most MAX_ROWS, `if m < BM` resolved at
compile time); rows past the expert's count are skipped. BD = 2 BN keeps a down
program's step as many bytes as a gate/up program's (two tiles of BN rows).

No K split: V3's decode already makes 512 gate/up and 896 down programs at the
default tiles, more than the machine holds at once, and a gate/up split would need
its parts combined before the SiLU.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.spec import Config
from kiln.codegen.expr.indexing import Lin, Opaque
from kiln.codegen.expr.values import Cond, mask_of
from kiln.codegen.templates.fp8_matmul import packed_product as packed
from kiln.codegen.templates.fp8_matmul.common import (
    fnuz_scale,
    from_e4m3fn,
    quantise_rows,
)
from kiln.codegen.templates.moe.analysis import MoeShape, pow2
from kiln.codegen.templates.moe.body import CG, MoeBody, lin_var
from kiln.codegen.templates.moe.fp8 import Fp8MoeBody
from kiln.ops.fp8_linear import BLOCK
from kiln.target import Target

GEMV_MAX_TOKENS = 8  # most tokens the decode form takes (decode at batch 1..8)
MAX_ROWS = 4  # most rows a tile unrolls
BLOCK_N = (16, 32, 64)  # BN gate/up rows; BD = 2 BN down rows
STEP_BLOCKS = (1, 2, 4)  # KB: 128-wide K blocks a step loads per weight row
WARPS = (4, 8)
MAX_STEP = STEP_BLOCKS[-1] * BLOCK  # the widest step: a multiple of it needs no K mask
MAX_ROWS_TILE = 2 * BLOCK_N[-1]  # the widest weight tile (BD): nor rows a row mask


def config_space(shape: MoeShape, tokens_hi: int) -> list[Config]:
    """Tiles of 1..MAX_ROWS rows (none above the tokens: a token's choices are
    distinct experts, so an expert has at most a row a token), BN by KB blocks a step,
    4 or 8 warps. A thread loads `step_bytes` a step: 64 to 256 with one row (4 to 16
    16-byte vectors in flight: fewer starve the memory system), 64 with more (every
    row's product keeps the widened step live: on sm_90 at V3's widths 128 bytes by
    2 rows took 232-255 registers, or spilled; 64 bytes by 2 or 4 rows 128-199)."""
    out = []
    for bm in (b for b in (1, 2, 4) if b <= max(1, min(MAX_ROWS, pow2(tokens_hi)))):
        for bn in reversed(BLOCK_N):
            for kb in reversed(STEP_BLOCKS):
                if kb * BLOCK > pow2(max(shape.dim, shape.inter)) and kb > 1:
                    continue
                for w in WARPS:
                    c = _config(w, bm, bn, kb)
                    if 64 <= step_bytes(c) <= (256 if bm == 1 else 64):
                        out.append(c)
    return out


def step_bytes(c: Config) -> int:
    """Weight bytes a thread loads a step: 2 BN rows (gate and up) or BD = 2 BN (down)
    by KB blocks of 128."""
    return 2 * c["BN"] * c["KB"] * BLOCK // (32 * c.num_warps)


def _config(warps: int, bm: int, bn: int, kb: int) -> Config:
    return Config.make(warps, 1, BM=bm, BN=bn, BD=2 * bn, KB=kb)


def heuristic(target: Target, tokens_hi: int) -> Config:
    """32 gate/up rows and 64 down rows, 4 warps. One token: one row a tile, 2
    blocks a step (a thread loads 8 16-byte vectors a step in both loops, as
    fp8_linear's GEMV default does; 128 registers on sm_90, four programs an SM).
    Up to GEMV_MAX_TOKENS: two rows a tile (a V3 batch of 8 gives a chosen expert 1.1
    rows on average; an expert with more takes more tiles, which read its weights
    again, mostly from L2) by one block a step (128 registers). The interpreter runs
    small steps fastest."""
    bm = 1 if tokens_hi <= 1 else 2
    kb = 2 if bm == 1 and target.backend != "interpret" else 1
    return _config(4, bm, 32, kb)


class Fp8MoeGemvBody(Fp8MoeBody):
    """Fp8MoeBody with the K loops as GEMVs: each tile row's own accumulators and
    quantised steps, no tl.dot."""

    def lines(self) -> list[str]:
        return [f"tl.static_assert(BM <= {MAX_ROWS})", *MoeBody.lines(self)]

    @staticmethod
    def _row(m: int, lines: list[str]) -> list[str]:
        """`lines` for tile row m: row 0 always, others where BM has them (an `if` on
        a constexpr, resolved when the kernel compiles)."""
        return lines if m == 0 else [f"if BM > {m}:", *_indent(lines)]

    def _gate_up_products(self) -> list[str]:
        s = self.s
        gs, us, _ = self.s.scales
        L = [*self._steps("nb * BN", "BN", s.inter)]
        for m in range(MAX_ROWS):
            L += self._row(m, [
                f"pair{m} = tl.load(moe_rows + e{self.wide} * n_pairs + row0 + {m}, "
                f"mask=row0 + {m} < rows_e, other=0, {CG})  # a valid token past the rows",
                f"tok{m} = pair{m}{self.wide} // {s.top_k}",
                f"acc_g{m} = tl.zeros([BN, KB], tl.float32)",
                f"acc_u{m} = tl.zeros([BN, KB], tl.float32)"])
        loop = self._k_offsets()
        k_ok = self._k_cond(s.dim)
        reads = []
        for m in range(MAX_ROWS):
            tok = Lin.of(Opaque(f"tok{m}", s.tokens))
            with self.em.block() as load:
                x = self.em.value(s.x, (tok, lin_var("kk", s.dim)), mask_of(k_ok))
            reads.append([*load, self._where(x.code, k_ok, m)])
        loop += self._loads_then_quantised(reads, [
            f"gs = {self._step_scale(gs, s.inter, s.dim)}",
            f"us = {self._step_scale(us, s.inter, s.dim)}",
            f"gw = {self._step_weight(s.gate, s.inter, s.dim)}",
            f"uw = {self._step_weight(s.up, s.inter, s.dim)}"])
        for m in range(MAX_ROWS):
            loop += self._accumulate(m, [("acc_g", "gw", "gs"), ("acc_u", "uw", "us")])
        return (L + [f"for k0 in range(0, {s.dim}, KB * {BLOCK}):", *_indent(loop)]
                + self._tile_sums(["acc_g", "acc_u"], "BN"))

    def _down_products(self) -> list[str]:
        s = self.s
        L = [*self._steps("db * BD", "BD", s.dim)]
        for m in range(MAX_ROWS):
            L += self._row(m, [
                f"h_row{m} = start_e{self.wide} + tl.minimum(row0 + {m}, rows_e - 1)",
                f"acc{m} = tl.zeros([BD, KB], tl.float32)"])
        loop = self._k_offsets()
        k_ok = self._k_cond(s.inter)
        mask = f", mask={k_ok.code}, other=0.0" if k_ok else ""
        reads = [[f"xf{m} = tl.load(moe_h + h_row{m} * {s.inter} + kk{mask}, {CG})"
                  ".to(tl.float32)"] for m in range(MAX_ROWS)]
        loop += self._loads_then_quantised(reads, [
            f"ds = {self._step_scale(s.scales[2], s.dim, s.inter)}",
            f"dw = {self._step_weight(s.down, s.dim, s.inter)}"])
        for m in range(MAX_ROWS):
            loop += self._accumulate(m, [("acc", "dw", "ds")])
        return (L + [f"for k0 in range(0, {s.inter}, KB * {BLOCK}):", *_indent(loop)]
                + self._tile_sums(["acc"], "BD"))

    # ---- pieces of both loops --------------------------------------------------------

    def _packs(self) -> bool:
        """The products in packed fp16 (fp8_matmul/packed_product.py): NVIDIA GPUs,
        both K widths whole steps (V3's 7168 and 2048)."""
        s = self.s
        return packed.packs(self.em.target, bool(s.dim % MAX_STEP or s.inter % MAX_STEP))

    def _loads_then_quantised(self, reads: list[list[str]], weights: list[str]) -> list[str]:
        """A step's lines: each tile row's x read (`reads`, setting `xf{m}`), then the
        scales' and weights' loads (`weights`: the last anchor, so x goes to the
        weight step's layout, not the step to x's), then each row's quantisation.
        Packed, the weights' loads go before any row's quantisation, whose reductions
        and layout barriers would hold them back; otherwise each row is quantised right
        after its read."""
        if not self._packs():
            return [*[x for m, r in enumerate(reads)
                      for x in self._row(m, [*r, *self._quantised(m)])], *weights]
        quantised = [x for m in range(len(reads)) for x in self._row(m, self._quantised(m))]
        return [*[x for m, r in enumerate(reads) for x in self._row(m, r)], *weights,
                *quantised]

    def _steps(self, first: str, width: str, n_rows: int) -> list[str]:
        """The program's weight rows `rw` [B] (from `first`), as the step tile's rows
        `wr` [B, 1, 1] and their scale rows `sr` [B, 1]."""
        return [f"rw = {first} + tl.arange(0, {width})",
                "wr = rw[:, None, None]  # [B, 1, 1] weight rows",
                f"sr = (rw // {BLOCK})[:, None]  # [B, 1] their scale rows"]

    def _k_offsets(self) -> list[str]:
        words = [f"kq = k0 // 4 + tl.arange(0, KB)[None, :, None] * {packed.WORDS} + "
                 f"tl.arange(0, {packed.WORDS})[None, None, :]  # [1, KB, 32] 4-byte words"]
        return [f"kk = k0 + tl.arange(0, KB)[None, :, None] * {BLOCK} + "
                f"tl.arange(0, {BLOCK})[None, None, :]  # [1, KB, 128]",
                *(words if self._packs() else []),
                f"kb = k0 // {BLOCK} + tl.arange(0, KB)[None, :]  # [1, KB] scale columns"]

    @staticmethod
    def _k_cond(size: int) -> Cond | None:
        """`kk < size` where a step of up to MAX_STEP may pass it."""
        return Cond(f"kk < {size}", frozenset({"kk"})) if size % MAX_STEP else None

    def _where(self, code: str, k_ok: Cond | None, m: int) -> str:
        """`xf{m}` [1, KB, 128] fp32: a computed x may be nonzero past K."""
        if k_ok is None:
            return f"xf{m} = tl.broadcast_to({code}.to(tl.float32), [1, KB, {BLOCK}])"
        return f"xf{m} = tl.where({k_ok.code}, {code}.to(tl.float32), 0.0)"

    def _quantised(self, m: int) -> list[str]:
        """Row m's step `xf{m}` quantised per 128-block as the op does: `xq{m}` (as
        fp32) and `xs{m}` [1, KB]; packed, its f16 pairs `xa{m}`, `xb{m}` and `xs{m}`."""
        target = self.em.target
        if self._packs():
            return packed.quantise_packed(f"xf{m}", m, target)
        return [*quantise_rows(f"xf{m}", target, axis=2), f"xq{m} = xq.to(tl.float32)",
                f"xs{m} = xs{fnuz_scale(target)}"]

    def _step_scale(self, name: str, n_rows: int, n_cols: int) -> str:
        """Expert `e`'s block scales [B, KB] of rows `sr` at K blocks `kb`."""
        rb, cb = -(-n_rows // BLOCK), -(-n_cols // BLOCK)
        ptr = self.p.tensor(name, torch.float32, (self.s.experts, rb, cb))
        return (f"tl.load({ptr} + e * {rb * cb} + sr * {cb} + kb, "
                f"mask=(sr < {rb}) & (kb < {cb}), other=0.0){fnuz_scale(self.em.target)}")

    def _step_weight(self, name: str, n_rows: int, n_cols: int) -> str:
        """Expert `e`'s e4m3 step [B, KB, 128] at rows `wr`, columns `kk`, as fp32 (a
        thread's 16 bytes of a row one vector load). Loaded after x's: Triton's layout
        propagation gives the products the layout of the last anchor, and were x's
        last, the weight tile would go through shared memory to reach it."""
        ptr = self.p.tensor(name, torch.float8_e4m3fn, (self.s.experts, n_rows, n_cols))
        ok = [c for c in (f"(wr < {n_rows})" if n_rows % MAX_ROWS_TILE else None,
                          f"(kk < {n_cols})" if n_cols % MAX_STEP else None) if c]
        if self._packs():  # [B, KB, 32] 4-byte words (no K mask: whole steps)
            masked = f", mask={' & '.join(ok)}, other=0" if ok else ""
            words = n_cols // 4
            return (f"tl.load(({ptr}).to(tl.pointer_type(tl.int32)) + e * {n_rows * words} "
                    f"+ wr * {words} + kq{masked})")
        masked = f", mask={' & '.join(ok)}, other=0.0" if ok else ""
        tile = f"tl.load({ptr} + e * {n_rows * n_cols} + wr * {n_cols} + kk{masked})"
        return f"{from_e4m3fn(tile, self.em.target)}.to(tl.float32)"

    def _accumulate(self, m: int, products: list[tuple[str, str, str]]) -> list[str]:
        """Row m's block products (sum_k xq w) * xs * ws into its accumulators; skipped
        past the expert's rows (row 0 always has one: the tile exists)."""
        step = []
        for acc, w, ws in products:
            prod = (packed.product(w, m, self.em.target) if self._packs()
                    else [f"prod = xq{m} * {w}"])
            step += [*prod, f"{acc}{m} += tl.sum(prod, 2) * xs{m} * {ws}"]
        return step if m == 0 else self._row(m, [f"if row0 + {m} < rows_e:", *_indent(step)])

    def _tile_sums(self, accs: list[str], width: str) -> list[str]:
        """Each accumulator as the tl.dot form's [BM, B] tile: row m's sums over the
        step's blocks at row m."""
        L = ["rm = tl.arange(0, BM)[:, None]"]
        for acc in accs:
            L.append(f"{acc} = tl.zeros([BM, {width}], tl.float32)")
            for m in range(MAX_ROWS):
                L += self._row(m, [
                    f"{acc} = tl.where(rm == {m}, tl.sum({acc}{m}, 1)[None, :], {acc})"])
        return L


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + x for x in lines]
