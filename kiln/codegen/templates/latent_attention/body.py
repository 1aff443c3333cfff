"""The latent attention kernel's body, as Triton source lines (template.py says what runs).

Kernel variables the emitter indexes with (so operands are read through their views):
`bb` batch row and `tq` query (scalars), `hh` [BLOCK_H, 1] head, `dr0`, `dr1`, ...
[1, RC] latent features of each chunk, `de` [1, PP] rope feature, `nk` [BLOCK_N, 1] key
(a position of the row).

The latent is held in CHUNKS column chunks (queries, cached rows, accumulators): the
scores are a sum of independent per-chunk products instead of one dot with K = 512,
whose tensor-core steps run one after another in each warp (an H100 under ncu: 2 warps
a scheduler, 0.26 of them ready; the kernel latency-bound at 9% of DRAM bandwidth).
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.indexing import Lin, Var, floordiv, modidx
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, Val, mask_code, mask_of
from kiln.codegen.templates import split_k as split
from kiln.codegen.templates.latent_attention import merge
from kiln.codegen.templates.latent_attention.analysis import LatentShape, pow2
from kiln.codegen.templates.matmul.template import dot_operand

LOG2E = 1.4426950408889634
CHUNKS = 4  # latent column chunks (each at least 16 wide: a tl.dot's K)
_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}


def _v(name: str, size, block: bool = True) -> Lin:
    return Lin.of(Var(name, size, block))


def _indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + x for x in lines]


class LatentBody:
    """Source lines of one program: a query of one batch row, BLOCK_H heads, one part
    of the keys (all of them without a split)."""

    def __init__(self, em: Emitter, p: SymbolicArgs, s: LatentShape):
        self.em, self.p, self.s = em, p, s
        self.rp, self.pp = pow2(s.latent_dim), pow2(s.rope_dim)
        self.rc = max(16, self.rp // CHUNKS)  # a chunk's columns
        self.chunks = range(self.rp // self.rc)
        self.wide = ".to(tl.int64)" if p.needs_int64 else ""
        self.b, self.t = _v("bb", s.batch, False), _v("tq", s.tq, False)
        self.h = _v("hh", s.heads)
        self.h_ok = Cond("h_ok", frozenset({"hh"}))
        self.r_ok = [Cond(f"dr{c} < {s.latent_dim}", frozenset({f"dr{c}"}))
                     if s.latent_dim < (c + 1) * self.rc else None for c in self.chunks]
        self.e_ok = (Cond(f"de < {s.rope_dim}", frozenset({"de"}))
                     if s.rope_dim != self.pp else None)

    def lines(self) -> list[str]:
        s, p = self.s, self.p
        L = [
            *merge.roles(self.wide, self.rp),
            f"bb = pid_z // {p.dim(s.tq)}",
            f"tq = pid_z % {p.dim(s.tq)}",
            "hr = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)",
            "hh = hr[:, None]",
            f"hr_ok = hr < {s.heads}",
            "h_ok = hr_ok[:, None]",
            *[f"dr{c} = tl.arange({c * self.rc}, {(c + 1) * self.rc})[None, :]"
              for c in self.chunks],
            f"de = tl.arange(0, {self.pp})[None, :]",
        ]
        with self.em.block() as pos_lines:
            pos = self.em.value(s.input_pos, (self.b, self.t))
        L += pos_lines + [f"kv_end = tl.minimum({pos.code}.to(tl.int64) + 1, "
                          f"{p.dim(s.keys)})  # keys 0..input_pos"]
        for c in self.chunks:
            L += self._tile(f"q{c}", s.q_latent,
                            (self.b, self.t, self.h, _v(f"dr{c}", s.latent_dim)),
                            mask_of(self.h_ok, self.r_ok[c]), f"[BLOCK_H, {self.rc}]",
                            {"hh", f"dr{c}"})
        L += self._tile("qr", s.q_rope, (self.b, self.t, self.h, _v("de", s.rope_dim)),
                        mask_of(self.h_ok, self.e_ok), f"[BLOCK_H, {self.pp}]", {"hh", "de"})
        L += [
            f"qk_scale = {s.scale * LOG2E!r}",
            'm_i = tl.full([BLOCK_H], float("-inf"), tl.float32)',
            "l_i = tl.zeros([BLOCK_H], tl.float32)",
            *[f"acc{c} = tl.zeros([BLOCK_H, {self.rc}], tl.float32)" for c in self.chunks],
            "lo = 0",
            "hi = kv_end",
            "per_split = kv_end",
            "if KV_SPLIT > 1:",
            *_indent(split.program_range("kv_end", "BLOCK_N")),
            "    hi = tl.where(merging, lo, hi)  # a merge program reads no keys",
            "for start_n in range(lo, hi, BLOCK_N):",
            *_indent(self._key_step()),
        ]
        L += self._combine()
        return L + self._store()

    def _tile(self, target: str, name: str, index, mask, tile: str, full: set) -> list[str]:
        """`target = ` operand `name` at `index` as a full `tile`, zero outside `mask`. A
        plain masked load is that already; a value a fused prologue computed (from
        masked loads: exp(0) is not 0, log(0) * 0 is NaN) or a view broadcast (not
        varying along all of `full`) is selected, so padded lanes add nothing to a dot."""
        with self.em.block() as lines:
            v = self.em.value(name, index, mask)
        if full <= v.vars and len(lines) == 1 and lines[0].startswith(f"{v.code} = tl.load("):
            return lines + [f"{target} = {v.code}"]
        code = v.code if full <= v.vars else f"tl.broadcast_to({v.code}, {tile})"
        ok = mask_code(mask)
        if ok:
            code = f"tl.where({ok}, {code}, 0.0).to({_TL[self.s.dtype]})"
        return lines + [f"{target} = {code}"]

    def _cache_rows(self) -> tuple[list[str], tuple]:
        """(lines, (row, slot)): where key `nk` of batch row `bb` lies in the cache. Paged:
        block_table[bb, nk // block_size], nk % block_size (the table read once per step,
        for both parts of the cache)."""
        s = self.s
        nk = _v("nk", s.keys)
        if not s.paged:
            return [], (self.b, nk)
        n_ok = Cond("n_ok", frozenset({"nk"}))
        with self.em.block() as lines:
            blk = self.em.value(s.block_table, (self.b, floordiv(nk, s.cache_len)),
                                mask_of(n_ok))
            self.em.check_index(blk, s.cache_rows, mask_of(n_ok), "kiln.latent_attention.default")
            blk = self.em.kept_in(blk, s.cache_rows)
        return lines, (self.em.opaque(blk, s.cache_rows), modidx(nk, 1, s.cache_len))

    def _dot(self, a: str, b: str, acc: str | None = None) -> str:
        s, target = self.s, self.em.target
        ieee = ', input_precision="ieee"' if s.dtype == torch.float32 else ""
        a, b = dot_operand(a, s.dtype, target), dot_operand(b, s.dtype, target)
        return f"tl.dot({a}, {b}{f', {acc}' if acc else ''}{ieee}, out_dtype=tl.float32)"

    def _key_step(self) -> list[str]:
        """One BLOCK_N step: the cache rows are read once, as keys and as values, for
        every head of the program."""
        s = self.s
        n_ok = Cond("n_ok", frozenset({"nk"}))
        L = [f"n = start_n + tl.arange(0, BLOCK_N){self.wide}", "nk = n[:, None]",
             "n_ok = nk < hi"]
        lines, at = self._cache_rows()
        L += lines
        for c in self.chunks:
            L += self._tile(f"kv{c}", s.kv_latent, (*at, _v(f"dr{c}", s.latent_dim)),
                            mask_of(n_ok, self.r_ok[c]), f"[BLOCK_N, {self.rc}]",
                            {"nk", f"dr{c}"})
        L += self._tile("kr", s.k_rope, (*at, _v("de", s.rope_dim)), mask_of(n_ok, self.e_ok),
                        f"[BLOCK_N, {self.pp}]", {"nk", "de"})
        with self.em.block() as p_lines:
            pr = self.em.cast(Val("pr", torch.float32, frozenset({"hh", "nk"})), s.dtype)
        parts = [self._dot(f"q{c}", f"tl.trans(kv{c})") for c in self.chunks]
        L += [
            # independent products (no accumulator chained through them), summed after
            f"qk = {self._dot('qr', 'tl.trans(kr)')} + {' + '.join(parts)}",
            'sc = tl.where(n[None, :] < hi, qk * qk_scale, float("-inf"))',
            "m_new = tl.maximum(m_i, tl.max(sc, 1))  # finite: the block has a key",
            "pr = tl.exp2(sc - m_new[:, None])",
            "alpha = tl.exp2(m_i - m_new)",
            "l_i = l_i * alpha + tl.sum(pr, 1)",
            *p_lines,
            *[f"acc{c} = {self._dot(pr.code, f'kv{c}', f'acc{c} * alpha[:, None]')}"
              for c in self.chunks],
            "m_i = m_new",
        ]
        return L

    def _combine(self) -> list[str]:
        """With the keys split (merge.py): a part program with keys stores its
        unnormalised acc, running max and sum; a merge program merges its chunks' DC
        columns of every part that had keys (parts past the row's keys are left unread) by their
        maxima, split.UNROLL parts a step, and stores them."""
        s, rp, rc = self.s, self.rp, self.rc
        dc = min(merge.DC, rp)
        numel = f"BLOCK_H * {rp + 2}"
        m_at, l_at = f"BLOCK_H * {rp} + ar", f"BLOCK_H * {rp + 1} + ar"
        store = ["ar = tl.arange(0, BLOCK_H)",
                 "if lo < hi:",
                 *[f"    tl.store({split.part(numel)} + ar[:, None] * {rp} + "
                   f"tl.arange({c * rc}, {(c + 1) * rc})[None, :], acc{c}, mask=h_ok)"
                   for c in self.chunks],
                 f"    tl.store({split.part(numel)} + {m_at}, m_i, mask=hr_ok)",
                 f"    tl.store({split.part(numel)} + {l_at}, l_i, mask=hr_ok)"]
        part = split.part(numel, "s")
        used = "(s < n_used)"
        m_part = split.load_part(f"{part} + {m_at}", f"hr_ok & {used}", 'float("-inf")')
        # every part's maximum and sum in one load each (a [KV_SPLIT, BLOCK_H] tile)
        sp = "tl.arange(0, KV_SPLIT)[:, None]"
        every = f"{split.PARTS} + (tile_id * n_split + {sp}) * ({numel})"
        on = f"({sp} < n_used) & hr_ok[None, :]"
        m_all = split.load_part(f"{every} + BLOCK_H * {rp} + ar[None, :]", on,
                                'float("-inf")')
        l_all = split.load_part(f"{every} + BLOCK_H * {rp + 1} + ar[None, :]", on)
        cols = f"ar[:, None] * {rp} + dc"
        with self.em.block() as out_lines:
            self.em.store(s.out, (self.b, self.t, self.h, _v("dc", s.latent_dim)),
                          self.em.let("o", torch.float32, frozenset({"hh", "dc"})),
                          mask_of(self.h_ok, Cond(f"dc < {s.latent_dim}", frozenset({"dc"}))))
        merged = [
            "ar = tl.arange(0, BLOCK_H)",
            "n_used = tl.cdiv(kv_end, per_split)",
            f"m_all = {m_all}",
            "m_i = tl.max(m_all, 0)",
            'm_use = tl.where(m_i == float("-inf"), 0.0, m_i)',
            f"l_i = tl.sum({l_all} * tl.exp2(m_all - m_use[None, :]), 0)",
            "l_inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)",
            f"for c0 in range(chunk0 * {dc}, {rp}, chunk_step * {dc}):  # the merger's chunks",
            *_indent([
                f"dc = c0 + tl.arange(0, {dc})[None, :]",
                f"o = tl.zeros([BLOCK_H, {dc}], tl.float32)",
                *split.merge_loop(f"BLOCK_H * {dc}", [
                    f"w = tl.exp2({m_part} - m_use) * l_inv",
                    f"o += {split.load_part(f'{part} + {cols}', f'h_ok & {used}')} * w[:, None]"],
                    count="n_used"),
                *out_lines]),
        ]
        return merge.combine(store, merged)

    def _store(self) -> list[str]:
        s, em = self.s, self.em
        L = ["l_inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)[:, None]"]
        for c in self.chunks:
            L.append(f"acc{c} = acc{c} * l_inv")
            with em.block() as lines:
                em.store(s.out, (self.b, self.t, self.h, _v(f"dr{c}", s.latent_dim)),
                         em.let(f"acc{c}", torch.float32, frozenset({"hh", f"dr{c}"})),
                         mask_of(self.h_ok, self.r_ok[c]))
            L += lines
        return L
