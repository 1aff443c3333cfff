"""The grouped MoE kernel's body, as Triton source lines (template.py says what runs).

Kernel variables the emitter indexes with (so operands are read through their views):
routers: `rt` [BT, 1] token, `rj` [1, KP] choice, `zd` [1, ZB] output column; the
products: `om` [BM, 1] row of the tile (its token `tok` and choice `jj` are loaded,
opaque indices), `ok` [1, BK] reduction column, `wn` [BN, 1] a gate / up row (the
intermediate feature), `wd` [BD, 1] a down row, `od` [1, BD] output column, `cj`
[1, KP] a token's choice; `e` the tile's expert (a scalar).

Scratch: `moe_ctr` int32 counters, zero between launches: [0] tickets taken, [1]
routers done, [2] programs done, then E per-expert row counts, one arrival count per
tile (its gate/up column blocks done), one per (token, output column block) (its
pairs' down products stored); `moe_rows` [E, N * k] each expert's pairs (n * k + j)
in the order they were counted; `moe_h` [N * k, I] silu(gate x) * up x per sorted
row, and `moe_o` [N * k, dim] each pair's weighted down product, both in x's dtype.
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.indexing import Lin, Opaque, Var
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, Mask, Val, mask_code, mask_of
from kiln.codegen.templates.matmul.template import dot_operand
from kiln.codegen.templates.moe.analysis import MoeShape, pow2

SCRATCH = ("moe_ctr", "moe_rows", "moe_h", "moe_o")
COUNTS = 4  # where the per-expert counts start in moe_ctr
BT = 32  # tokens a router takes
MAX_TILE = 256  # the widest tile of any config (template.py)
ZB = 128  # output columns a router zeroes at a time (tokens that chose no expert)
_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}
CG = 'cache_modifier=".cg"'  # written by other programs of this launch: read L2


def lin_var(name: str, size, block: bool = True) -> Lin:
    return Lin.of(Var(name, size, block))


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + x for x in lines]


def tail_cond(var: str, size: int) -> Cond | None:
    """`var < size` where a tile of up to MAX_TILE columns may pass `size`."""
    return Cond(f"{var} < {size}", frozenset({var})) if size % MAX_TILE else None


class MoeBody:
    """Source lines of every program of the one launch: a ticket says its role."""

    def __init__(self, em: Emitter, p: SymbolicArgs, s: MoeShape):
        self.em, self.p, self.s = em, p, s
        self.kp, self.ep = pow2(s.top_k), pow2(s.experts)
        self.wide = ".to(tl.int64)" if p.needs_int64 else ""
        self.n = p.dim(s.tokens)
        self.r_ok = Cond("r_ok", frozenset({"om"}))
        self.tok = Lin.of(Opaque("tok", s.tokens, frozenset({"om"})))
        self.expert = Lin.of(Opaque("e", s.experts))

    def lines(self) -> list[str]:
        s = self.s
        L = [
            "ticket = tl.atomic_add(moe_ctr, 1)",
            f"n_tok = {self.n}",
            f"n_pairs = n_tok * {s.top_k}",
            f"n_route = tl.cdiv(n_tok, {BT})",
            f"n_tiles = tl.minimum(n_pairs, tl.cdiv(n_pairs, BM) + {s.experts})",
            f"nb_up = tl.cdiv({s.inter}, BN)",
            f"nb_down = tl.cdiv({s.dim}, BD)",
            "n_up = n_tiles * nb_up",
            f"tile_ctr = moe_ctr + {COUNTS + s.experts}",
            "tok_ctr = tile_ctr + n_tiles",
            "if ticket < n_route:",
            *_indent(self._route()),
            "else:",
            *_indent([
                "# every router has counted: the experts' row counts are final",
                'while tl.atomic_add(moe_ctr + 1, 0, sem="acquire") < n_route:',
                "    pass",
                *self._tiles(),
                "if ticket < n_route + n_up:",
                *_indent(self._gate_up()),
                "else:",
                *_indent(self._down())]),
            *self._finish(),
        ]
        return L

    # ---- routers ---------------------------------------------------------------------

    def _route(self) -> list[str]:
        """BT tokens' k choices: each valid pair takes the next row of its expert (an
        atomic count) and is written there; tokens with no valid choice get zero rows
        (no pair will arrive to store them)."""
        s, em = self.s, self.em
        rt, rj = lin_var("rt", s.tokens), lin_var("rj", s.top_k)
        t_ok = Cond("t_ok", frozenset({"rt"}))
        j_ok = Cond(f"rj < {s.top_k}", frozenset({"rj"})) if self.kp != s.top_k else None
        L = [f"tt = ticket{self.wide} * {BT} + tl.arange(0, {BT})",
             "rt = tt[:, None]",
             f"rj = tl.arange(0, {self.kp})[None, :]",
             "t_ok = rt < n_tok"]
        with em.block() as load:
            ids = em.value(s.ids, (rt, rj), mask_of(t_ok, j_ok))
        L += load + [
            f"valid = t_ok & (rj < {s.top_k}) & ({ids.code} >= 0) & ({ids.code} < {s.experts})",
            f"eid = tl.where(valid, {ids.code}, 0).to(tl.int32)",
            f"slot = tl.atomic_add(moe_ctr + {COUNTS} + eid, 1, mask=valid)",
            f"tl.store(moe_rows + eid{self.wide} * n_pairs + slot, (rt * {s.top_k} + rj)"
            ".to(tl.int32), mask=valid)",
            "none = t_ok & (tl.sum(valid.to(tl.int32), 1)[:, None] == 0)",
            "if tl.max(none.to(tl.int32)) > 0:",
            f"    for z0 in range(0, {s.dim}, {ZB}):",
            *_indent(self._zero_rows(), 2),
            "tl.debug_barrier()  # the CTA's rows are stored before it is counted",
            'tl.atomic_add(moe_ctr + 1, 1, sem="release")',
        ]
        return L

    def _zero_rows(self) -> list[str]:
        s, em = self.s, self.em
        L = [f"zd = z0 + tl.arange(0, {ZB})[None, :]"]
        with em.block() as store:
            em.store(s.out, (lin_var("rt", s.tokens), lin_var("zd", s.dim)),
                     em.let(f"tl.zeros([{BT}, {ZB}], tl.float32)", torch.float32,
                            frozenset({"rt", "zd"})),
                     mask_of(Cond("none", frozenset({"rt"})),
                             Cond(f"zd < {s.dim}", frozenset({"zd"}))))
        return L + store

    # ---- where a tile's rows are -------------------------------------------------------

    def _tiles(self) -> list[str]:
        """Each expert's rows (its count), their BM-row tiles numbered expert by expert,
        and each expert's first row in the sorted buffers (exclusive sums)."""
        return [
            f"ee = tl.arange(0, {self.ep})",
            f"cnt = tl.load(moe_ctr + {COUNTS} + ee, mask=ee < {self.s.experts}, other=0, "
            f"{CG})",
            "tiles_e = (cnt + BM - 1) // BM",
            "tile_end = tl.cumsum(tiles_e, 0)",
            "row_end = tl.cumsum(cnt, 0)",
            "used = tl.sum(tiles_e, 0)",
        ]

    def _tile(self, ticket: str, blocks: str, block: str) -> list[str]:
        """Lines setting tile `s` (and column block `block`) of work item `ticket`, its
        expert `e`, the expert's rows `rows_e` and first sorted row `start_e`, the
        tile's rows `om`, their pairs, tokens `tok` and choices `jj`."""
        s = self.s
        return [
            f"s = ({ticket}) // {blocks}",
            f"{block} = ({ticket}) % {blocks}",
            f"e = tl.sum((tile_end <= s).to(tl.int32), 0){self.wide}",
            "at_e = ee == e",
            "rows_e = tl.sum(tl.where(at_e, cnt, 0), 0)",
            "start_e = tl.sum(tl.where(at_e, row_end - cnt, 0), 0)",
            "row0 = (s - tl.sum(tl.where(at_e, tile_end - tiles_e, 0), 0)) * BM",
            "om = row0 + tl.arange(0, BM)[:, None]",
            "r_ok = om < rows_e",
            f"pair = tl.load(moe_rows + e{self.wide} * n_pairs + om, mask=r_ok, other=0, {CG})",
            f"tok = pair{self.wide} // {s.top_k}",
            f"jj = pair{self.wide} % {s.top_k}",
            f"h_row = start_e{self.wide} + om",
        ]

    def _operand(self, target: str, name: str, index, mask: Mask, tile: str,
                 full: set) -> list[str]:
        """`target = ` operand `name` at `index` as a full `tile`, zero outside `mask` (as
        latent_attention's: a plain masked load already is; a computed or broadcast
        value is selected, so padded lanes add nothing to a dot)."""
        with self.em.block() as lines:
            v = self.em.value(name, index, mask)
        if full <= v.vars and len(lines) == 1 and lines[0].startswith(f"{v.code} = tl.load("):
            return lines + [f"{target} = {v.code}"]
        code = v.code if full <= v.vars else f"tl.broadcast_to({v.code}, {tile})"
        ok = mask_code(mask)
        if ok:
            code = f"tl.where({ok}, {code}, 0.0).to({_TL[self.s.dtype]})"
        return lines + [f"{target} = {code}"]

    def _dot(self, a: str, b: str, acc: str) -> str:
        s, target = self.s, self.em.target
        ieee = ', input_precision="ieee"' if s.dtype == torch.float32 else ""
        a, b = dot_operand(a, s.dtype, target), dot_operand(b, s.dtype, target)
        return f"tl.dot({a}, {b}, {acc}{ieee}, out_dtype=tl.float32)"

    # ---- gate / up ------------------------------------------------------------------------

    def _gate_up_step(self) -> list[str]:
        """One BK step of the gate and up products: `acc_g`, `acc_u` += x tile times
        the weight tiles (x read once for both)."""
        s = self.s
        k_ok = tail_cond("ok", s.dim)
        x_mask = mask_of(self.r_ok, k_ok)
        w_mask = mask_of(tail_cond("wn", s.inter), k_ok)
        ok, wn = lin_var("ok", s.dim), lin_var("wn", s.inter)
        step = ["ok = k0 + tl.arange(0, BK)[None, :]"]
        step += self._operand("xt", s.x, (self.tok, ok), x_mask, "[BM, BK]", {"om", "ok"})
        step += self._operand("gt", s.gate, (self.expert, wn, ok), w_mask, "[BN, BK]",
                              {"wn", "ok"})
        step += self._operand("ut", s.up, (self.expert, wn, ok), w_mask, "[BN, BK]",
                              {"wn", "ok"})
        return step + [f"acc_g = {self._dot('xt', 'tl.trans(gt)', 'acc_g')}",
                       f"acc_u = {self._dot('xt', 'tl.trans(ut)', 'acc_u')}"]

    def _gate_up(self) -> list[str]:
        """One tile's rows times BN rows of its expert's gate and up (x gathered by
        token, read once for both), silu(gate) * up stored to moe_h; then the tile
        counts one more of its column blocks done."""
        s = self.s
        with self.em.block() as cast:
            h = self.em.cast(Val("h", torch.float32, frozenset({"om", "on"})), s.dtype)
        L = [*self._tile("ticket - n_route", "nb_up", "nb"),
             "if s < used:",
             *_indent([
                 "on = nb * BN + tl.arange(0, BN)[None, :]",
                 *self._gate_up_products(),
                 *self._swiglu(),
                 *cast,
                 f"tl.store(moe_h + h_row * {s.inter} + on, {h.code}, "
                 f"mask=r_ok & (on < {s.inter}))",
                 "tl.debug_barrier()  # the CTA's rows are stored before they are counted",
                 'tl.atomic_add(tile_ctr + s, 1, sem="release")'])]
        return L

    def _gate_up_products(self) -> list[str]:
        """`acc_g`, `acc_u` [BM, BN] (fp32): the tile's rows times gate and up rows
        `nb * BN`.. of expert `e`, a tl.dot per BK step."""
        return ["wn = nb * BN + tl.arange(0, BN)[:, None]",
                "acc_g = tl.zeros([BM, BN], tl.float32)",
                "acc_u = tl.zeros([BM, BN], tl.float32)",
                f"for k0 in range(0, {self.s.dim}, BK):",
                *_indent(self._gate_up_step())]

    def _swiglu(self) -> list[str]:
        """`h` (fp32) = silu(gate) * up of the accumulators."""
        return ["h = acc_g * tl.sigmoid(acc_g) * acc_u  # silu(gate) * up"]

    # ---- down and the combine ---------------------------------------------------------------

    def _weighted(self, weight: str) -> list[str]:
        """`o` (fp32) = the down product times each row's routing weight."""
        return [f"o = acc * {weight}"]

    def _h_tile(self) -> list[str]:
        """`ht` [BM, BK]: the tile's rows of moe_h at this step (zeros past them)."""
        s = self.s
        h_mask = mask_code(mask_of(self.r_ok, tail_cond("ok", s.inter)))
        return ["ok = k0 + tl.arange(0, BK)[None, :]",
                f"ht = tl.load(moe_h + h_row * {s.inter} + ok, mask={h_mask}, other=0.0, {CG})"]

    def _down_step(self) -> list[str]:
        """One BK step of the down product: `acc` += the h tile times the down tile."""
        s = self.s
        ok, wd = lin_var("ok", s.inter), lin_var("wd", s.dim)
        w_mask = mask_of(tail_cond("wd", s.dim), tail_cond("ok", s.inter))
        step = self._h_tile()
        step += self._operand("dt", s.down, (self.expert, wd, ok), w_mask, "[BD, BK]",
                              {"wd", "ok"})
        return step + [f"acc = {self._dot('ht', 'tl.trans(dt)', 'acc')}"]

    def _down_products(self) -> list[str]:
        """`acc` [BM, BD] (fp32): the tile's h rows times down rows `db * BD`.. of
        expert `e`, a tl.dot per BK step."""
        return ["wd = db * BD + tl.arange(0, BD)[:, None]",
                "acc = tl.zeros([BM, BD], tl.float32)",
                f"for k0 in range(0, {self.s.inter}, BK):",
                *_indent(self._down_step())]

    def _down(self) -> list[str]:
        """Once every gate/up column block of its tile is stored: the tile's rows times
        BD rows of its expert's down, times each pair's routing weight, stored at the
        pair's row of moe_o; then each row counts its arrival at (token, column block),
        and the program that brings a token's last pair sums the token's rows in the
        order of j and stores y."""
        s = self.s
        with self.em.block() as weight:
            w = self.em.value(s.weights, (self.tok, Lin.of(Opaque("jj", s.top_k,
                                                                 frozenset({"om"})))),
                              mask_of(self.r_ok))
        with self.em.block() as cast:
            o = self.em.cast(Val("o", torch.float32, frozenset({"om", "od"})), s.dtype)
        L = [*self._tile("ticket - n_route - n_up", "nb_down", "db"),
             "if s < used:",
             *_indent([
                 'while tl.atomic_add(tile_ctr + s, 0, sem="acquire") < nb_up:',
                 "    pass",
                 "od = db * BD + tl.arange(0, BD)[None, :]",
                 *self._down_products(),
                 *weight,
                 *self._weighted(w.code),
                 *cast,
                 f"d_ok = od < {s.dim}",
                 f"tl.store(moe_o + pair{self.wide} * {s.dim} + od, {o.code}, mask=r_ok & d_ok)",
                 "tl.debug_barrier()  # the CTA's rows are stored before they are counted",
                 "at = tok_ctr + tok * nb_down + db",
                 'arrived = tl.atomic_add(at, 1, mask=r_ok, sem="acq_rel")',
                 *self._valid_choices(),
                 "last = r_ok & (arrived == n_valid - 1)",
                 "tl.debug_barrier()  # every lane sees what the counting lanes acquired",
                 "if tl.max(last.to(tl.int32)) > 0:",
                 *_indent(self._combine())])]
        return L

    def _valid_choices(self) -> list[str]:
        """`n_valid` [BM, 1]: how many of each row's token's k ids name an expert (the
        pairs that arrive for it)."""
        s, em = self.s, self.em
        cj = lin_var("cj", s.top_k)
        j_ok = Cond(f"cj < {s.top_k}", frozenset({"cj"})) if self.kp != s.top_k else None
        with em.block() as load:
            ids = em.value(s.ids, (self.tok, cj), mask_of(self.r_ok, j_ok))
        return [f"cj = tl.arange(0, {self.kp})[None, :]", *load,
                f"chosen = (cj < {s.top_k}) & ({ids.code} >= 0) & ({ids.code} < {s.experts})",
                "n_valid = tl.sum(chosen.to(tl.int32), 1)[:, None]"]

    def _combine(self) -> list[str]:
        """The rows whose token is complete: its pairs' rows of moe_o summed in fp32 in
        the order of j (the same whatever program brought which), stored as y; the
        token's counter is zeroed for the next launch."""
        s, em = self.s, self.em
        jv = lin_var("j", s.top_k, False)
        with em.block() as load:
            idj = em.value(s.ids, (self.tok, jv), mask_of(Cond("last", frozenset({"om"}))))
        with em.block() as store:
            em.store(s.out, (self.tok, lin_var("od", s.dim)),
                     Val("y", torch.float32, frozenset({"om", "od"})),
                     mask_of(Cond("last", frozenset({"om"})), Cond("d_ok", frozenset({"od"}))))
        return [
            "y = tl.zeros([BM, BD], tl.float32)",
            f"for j in range(0, {s.top_k}):",
            *_indent([*load,
                      f"use = last & ({idj.code} >= 0) & ({idj.code} < {s.experts})",
                      f"y += tl.load(moe_o + (tok * {s.top_k} + j) * {s.dim} + od, "
                      f"mask=use & d_ok, other=0.0, {CG}).to(tl.float32)"]),
            *store,
            "tl.store(at, 0, mask=last)  # zero again for the next launch",
        ]

    # ---- the end -----------------------------------------------------------------------------

    def _finish(self) -> list[str]:
        """The last program to finish zeroes the tickets, counts and tile counters."""
        s = self.s
        return [
            'finished = tl.atomic_add(moe_ctr + 2, 1, sem="acq_rel")',
            "if finished == tl.num_programs(0) - 1:",
            f"    for z0 in range(0, {COUNTS + s.experts} + n_tiles, 1024):",
            "        zz = z0 + tl.arange(0, 1024)",
            f"        tl.store(moe_ctr + zz, 0, mask=zz < {COUNTS + s.experts} + n_tiles)",
        ]
