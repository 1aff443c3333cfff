"""Accumulators of a row kernel, as Triton code.

A persistent kernel reduces its [XBLOCK, RBLOCK] tile straight to row values
(`reduce_tiles`). A looped kernel keeps a [XBLOCK, RBLOCK] accumulator per reduction
(`init`), folds each chunk of the row into it (`update`: masked lanes contribute the
identity), and reduces it after the loop (`finish`). Argmax keeps each lane's first
best position (int32 unless the row may pass 2**31); `lse` keeps a running max with a
sum rescaled to it (online softmax, one exp per element).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.values import TL, Val, literal
from kiln.codegen.templates.reduction.reduce_ops import Acc

TILE = frozenset({"xindex", "rindex"})  # what a [XBLOCK, RBLOCK] value varies with
ROW = frozenset({"xindex"})  # ... and a [XBLOCK, 1] row value


class Accumulators:
    def __init__(self, em: Emitter, full_index: Callable[[], tuple],
                 index_dtype: torch.dtype = torch.int64):
        self.em = em
        self.full_index = full_index
        self.index_dtype = index_dtype  # of argmax / argmin positions

    def ident(self, acc: Acc) -> Val:
        dt = acc.dtype
        if acc.kind in ("sum", "any"):
            return literal(0, dt)
        if acc.kind in ("prod", "all"):
            return literal(1, dt)
        low = acc.kind in ("max", "argmax", "lse")
        if dt.is_floating_point:
            return literal(float("-inf") if low else float("inf"), dt)
        info = torch.iinfo(dt)
        return literal(info.min if low else info.max, dt)

    def tile_input(self, acc: Acc, mask) -> Val:
        """The accumulator's input at this tile, masked lanes set to the identity."""
        em = self.em
        v = em.tensor(em.cast(acc.value(self.full_index(), mask), acc.dtype))
        tile = f"tl.broadcast_to({v}, [XBLOCK, RBLOCK])"
        m = " & ".join(sorted(c.code for c in mask))
        code = f"tl.where({m}, {tile}, {self.ident(acc)})" if m else tile
        return em.let(code, acc.dtype, TILE)

    def reduce_tiles(self, accs: list[Acc], mask) -> None:
        """Reduce each accumulator's tile, every input first: their loads are then in
        flight together (the gathered experts' gate and up rows), not each after the
        cross-warp reduction before it (a barrier the loads do not move across)."""
        tiles = [self.tile_input(acc, mask) for acc in accs]
        for acc, v in zip(accs, tiles):
            self.final(acc, v, self.rindex_tile() if acc.kind.startswith("arg") else None)

    def rindex_tile(self) -> Val:
        dt = self.index_dtype
        return self.em.let(f"tl.broadcast_to(rindex, [XBLOCK, RBLOCK]).to({TL[dt]})", dt, TILE)

    def final(self, acc: Acc, tile: Val, idx: Val | None) -> None:
        """Reduce a [XBLOCK, RBLOCK] tile of partial results to the row value.

        tl.reduce with triton.language's own combine functions (what tl.sum / tl.max
        call): the interpreter cannot call tl.sum itself, but it recognises these and
        reduces with numpy. Prod and floating max / min use combine functions of kiln's.
        """
        em, dt, k = self.em, acc.dtype, acc.kind
        if k in ("sum", "any", "all"):
            combine = {"sum": "_sum_combine", "any": "_elementwise_max",
                       "all": "_elementwise_min"}[k]
            acc.result = em.let(f"tl.reduce({tile}, 1, tl.standard.{combine})[:, None]", dt, ROW)
            if k != "sum":
                acc.result = em.let(f"{acc.result} != 0", torch.bool, ROW)
        elif k == "prod":
            em.need("_prod")
            acc.result = em.let(f"tl.reduce({tile}, 1, _prod)[:, None]", dt, ROW)
        else:
            acc.result = self.extreme(tile, "max" if k in ("max", "argmax") else "min", dt)
            if idx is not None:  # the first position holding it (the first NaN, if any)
                m = acc.result
                cand = f"({tile} == {m})"
                if dt.is_floating_point:
                    cand += f" | (({tile} != {tile}) & ({m} != {m}))"
                never = torch.iinfo(idx.dtype).max
                acc.index = em.let(f"tl.reduce(tl.where({cand}, {idx}, {never}), 1, "
                                   "tl.standard._elementwise_min)[:, None]", idx.dtype, ROW)

    def extreme(self, tile: Val, kind: str, dt) -> Val:
        """Row max / min. Floating ones propagate NaN as torch does (PTX's plain max.f32
        and numpy's fmax would drop it): one max.NaN per element, no NaN count."""
        if not dt.is_floating_point:
            return self.em.let(f"tl.reduce({tile}, 1, tl.standard._elementwise_{kind})[:, None]",
                               dt, ROW)
        self.em.need(f"_{kind}_nan")
        return self.em.let(f"tl.reduce({tile}, 1, _{kind}_nan)[:, None]", dt, ROW)

    def init(self, acc: Acc) -> None:
        em = self.em
        acc.var = em.let(f"tl.full([XBLOCK, RBLOCK], {self.ident(acc)}, {TL[acc.dtype]})",
                         acc.dtype, TILE).code
        if acc.kind.startswith("arg"):
            dt = self.index_dtype
            acc.index_var = em.let(f"tl.full([XBLOCK, RBLOCK], 0, {TL[dt]})", dt, TILE).code
        if acc.kind == "lse":
            acc.index_var = em.let(f"tl.full([XBLOCK, RBLOCK], 0.0, {TL[acc.dtype]})",
                                   acc.dtype, TILE).code

    def update(self, acc: Acc, mask) -> None:
        em = self.em
        v = self.tile_input(acc, mask)
        a = acc.var
        k = acc.kind
        if k == "sum":
            em.lines.append(f"{a} = {a} + {v}")
        elif k == "prod":
            em.lines.append(f"{a} = {a} * {v}")
        elif k in ("max", "min"):
            nan = ", propagate_nan=tl.PropagateNan.ALL" if acc.dtype.is_floating_point else ""
            em.lines.append(f"{a} = tl.{k}imum({a}, {v}{nan})")
        elif k == "any":
            em.lines.append(f"{a} = tl.maximum({a}, {v})")
        elif k == "all":
            em.lines.append(f"{a} = tl.minimum({a}, {v})")
        elif k == "lse":
            # running max m; the sum s rescaled to it (0 while all seen are -inf). One
            # exp per element, of the smaller minus the larger: a new max rescales s and
            # counts itself (s * d + 1), else the element adds d. A NaN sticks as the max.
            s, dt = acc.index_var, acc.dtype
            up = em.let(f"({v} > {a}) | ({v} != {v})", torch.bool, TILE)
            m = em.let(f"tl.where({up}, {v}, {a})", dt, TILE)
            d = em.let(f"tl.exp(tl.where({up}, {a}, {v}) - {m})", dt, TILE)
            em.lines.append(f'{s} = tl.where({m} == -float("inf"), 0.0, '
                            f"tl.where({up}, {s} * {d} + 1.0, {s} + {d}))")
            em.lines.append(f"{a} = {m}")
        else:
            cmp = ">" if k == "argmax" else "<"
            # strictly better keeps each lane's first position; the first NaN wins
            take = em.let(f"({v} {cmp} {a}) | (({v} != {v}) & ({a} == {a}))", torch.bool, TILE)
            ridx = self.rindex_tile()
            em.lines.append(f"{a} = tl.where({take}, {v}, {a})")
            em.lines.append(f"{acc.index_var} = tl.where({take}, {ridx}, {acc.index_var})")

    def finish(self, acc: Acc) -> None:
        if acc.kind == "lse":
            em, dt = self.em, acc.dtype
            m = self.extreme(Val(acc.var, dt, TILE), "max", dt)
            acc.result = m
            acc.total = em.let(
                f'tl.reduce(tl.where({acc.var} == -float("inf"), 0.0, {acc.index_var} * '
                f"tl.exp({acc.var} - {m})), 1, tl.standard._sum_combine)[:, None]", dt, ROW)
            return
        idx = Val(acc.index_var, self.index_dtype, TILE) if acc.kind.startswith("arg") else None
        self.final(acc, Val(acc.var, acc.dtype, TILE), idx)
