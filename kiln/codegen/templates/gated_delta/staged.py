"""The staged form's two roles after the preparers (launch.py says how they share a launch).

The one-pass walker (body.walk) computes each chunk's outputs itself, so four products
per chunk sit on its sequential path. Here the walk keeps only the two the state needs,
as flash-linear-attention's chunk_gated_delta_rule_fwd_h does: per chunk it stores the
state before the chunk (`gd_h`, in q's dtype) and the chunk's effective values
U = U0 - W S (over U0 in `gd_u`), then updates the state and counts the chunk done on
its flag (`gd_flag`, one per walker). Output programs, one per (chunk, sequence, value
head, BV columns), wait for their walker's flag to pass their chunk and compute
o = exp(G) scale q h + scores U in parallel with the rest of the walk.

Scratch `gd_h` holds a [KP, VP] state per (chunk slot, value head): slot
`bb * cdiv(T, CHUNK) + j` for chunk j of batch row bb, or `nn + c0 // CHUNK` for packed
sequences (unique: each sequence starts at or after the previous one's end).
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, mask_of
from kiln.codegen.templates.gated_delta.analysis import DeltaShape
from kiln.codegen.templates.gated_delta.body import (
    KB,
    TL,
    blocks_of,
    chunk_rows,
    dots,
    head_vars,
    indent,
    lin,
    load_tile,
    state_blocks,
    transposed_keys,
)

SCRATCH = ("gd_h", "gd_flag")
_CG = 'cache_modifier=".cg"'  # written by other programs of this launch: read L2


def flag(s: DeltaShape) -> str:
    """The walker's flag: one per (sequence, value head, BV columns)."""
    return f"gd_flag + (nn * {s.value_heads} + hv) * tl.cdiv({s.value_dim}, BV) + vb"


def _slot(s: DeltaShape, p: SymbolicArgs) -> str:
    if s.cu_seqlens is not None:
        return "nn + c0 // CHUNK"
    return f"bb * tl.cdiv({p.dim(s.seq)}, CHUNK) + c0 // CHUNK"


def _state_row(s: DeltaShape, p: SymbolicArgs, kp: int) -> str:
    """`hrow = `: the first [VP]-row of this chunk's stored state (int64)."""
    return f"hrow = (({_slot(s, p)}).to(tl.int64) * {s.value_heads} + hv) * {kp}"


def walk_states(em: Emitter, p: SymbolicArgs, s: DeltaShape, kp: int, vp: int,
                tokens: str) -> list[str]:
    """The staged walker: its fp32 state as KB-row blocks S0, S1, ... (rows kr_i, in-bounds
    s_ok_i) loaded, walked over the chunks, and stored when the op returns it.

    Each chunk is two products, W S and k^T U (into S as the accumulator). The decay to
    the chunk's end scales U's rows once and the keys are read transposed ([KB, CHUNK]),
    all blocks' loads issued before the first update: k takes no fp32 round trip or
    transpose (H200, seed shape: 10.0 -> 9.5 us a chunk; 8.3 with the loads together).
    One state tile (256 rows: 2 waits a chunk, not 8) spilled 46-132 registers and ran
    11.8 us a chunk; the key loads moved to the chunk's start gave nothing more."""
    dot, _ = dots(em, s)
    dt = TL[s.dtype]
    b, hk, _ = head_vars(s)
    kw = min(KB, kp)
    blocks = range(len(blocks_of(kp)))
    inner = [*chunk_rows(s, tokens), _state_row(s, p, kp),
             f"U = tl.load(gd_u + rr * {vp} + ev, mask=t_ok & (ev < {s.value_dim}), other=0.0, "
             f"{_CG}).to(tl.float32)",
             f"G = tl.load(gd_g + row, mask=tc_ok, other=0.0, {_CG})",
             "last = tl.minimum(eos - c0, CHUNK) - 1",
             "G_end = tl.sum(tl.where(rows == last, G, 0.0), 0)",
             "ks = tl.exp(G_end - G)"]
    for i in blocks:
        inner += [f"W{i} = tl.load(gd_w + rr * {kp} + ek{i}, mask=t_ok, other=0.0, {_CG})",
                  f"Sd{i} = S{i}.to({dt})",
                  f"tl.store(gd_h + (hrow + kr{i}) * {vp} + ev, Sd{i}, mask=s_ok{i})",
                  f"WS = {'' if i == 0 else 'WS + '}{dot(f'W{i}', f'Sd{i}')}"]
    inner += ["U = U - WS", f"Ud = U.to({dt})",
              f"tl.store(gd_u + rr * {vp} + ev, Ud, mask=t_ok & (ev < {s.value_dim}))",
              f"Uk = (U * ks[:, None]).to({dt})"]
    inner += transposed_keys(em, s, kp)
    for i in blocks:
        inner += [f"S{i} = {dot(f'kt{i}', 'Uk')[:-1]}, acc=S{i} * tl.exp(G_end))"]
    inner += ["tl.debug_barrier()  # the CTA's stores of this chunk land before the count",
              f'tl.atomic_add({flag(s)}, 1, sem="release")']
    L = state_blocks(em, s, kp, final=False)
    L += [f"ek{i} = {k0} + tl.arange(0, {kw})[None, :]" for i, k0 in enumerate(blocks_of(kp))]
    L += ["for c0 in range(bos, eos, CHUNK):", *indent(inner)]
    return L + (state_blocks(em, s, kp, final=True) if s.final_state else [])


def outputs(em: Emitter, p: SymbolicArgs, s: DeltaShape, kp: int, vp: int,
            tokens: str) -> list[str]:
    """An output program's chunk (c0 from jj, the chunk's index in its sequence): wait
    for the walker, then o = (exp(G) scale q) h + scores U."""
    dot, _ = dots(em, s)
    dt = TL[s.dtype]
    b, hk, hv = head_vars(s)
    tt = lin("tt", s.seq)
    tcond = Cond("t_ok", frozenset({"tt"}))
    vc = Cond(f"ev < {s.value_dim}", frozenset({"ev"}))
    kw = min(KB, kp)
    L = [f"while tl.load({flag(s)}, volatile=True) <= jj:",
         "    pass",
         f'tl.atomic_add({flag(s)}, 0, sem="acquire")  # the walker\'s stores are seen',
         *chunk_rows(s, tokens), _state_row(s, p, kp),
         f"G = tl.load(gd_g + row, mask=tc_ok, other=0.0, {_CG})",
         f"qs = tl.exp(G) * {s.scale!r}",
         f"Aqk = tl.load(gd_a + rr * CHUNK + rows[None, :], mask=t_ok, other=0.0, {_CG})",
         f"U = tl.load(gd_u + rr * {vp} + ev, mask=t_ok & (ev < {s.value_dim}), other=0.0, "
         f"{_CG})"]
    for i, k0 in enumerate(blocks_of(kp)):
        e, r = f"ek{i}", f"kr{i}"
        kc = Cond(f"{e} < {s.key_dim}", frozenset({e}))
        L += [f"{e} = {k0} + tl.arange(0, {kw})[None, :]",
              f"{r} = {k0} + tl.arange(0, {kw})[:, None]"]
        L += load_tile(em, s.q, (b, tt, hk, lin(e, s.key_dim)), mask_of(tcond, kc), f"q{i}",
                   f"[CHUNK, {kw}]", f"t_ok & ({e} < {s.key_dim})", dt)
        L += [f"h{i} = tl.load(gd_h + (hrow + {r}) * {vp} + ev, "
              f"mask=({r} < {s.key_dim}) & (ev < {s.value_dim}), other=0.0, {_CG})",
              f"o = {'' if i == 0 else 'o + '}{dot(f'q{i}', f'h{i}')}"]
    L.append(f"o = o * qs[:, None] + {dot('Aqk', 'U')}  # q's rows scaled once, after")
    if s.out is not None:
        with em.block() as lines:
            em.store(s.out, (b, tt, hv, lin("ev", s.value_dim)),
                     em.let("o", torch.float32, frozenset({"tt", "ev"})), mask_of(tcond, vc))
        L += lines
    return L

