"""The gated delta rule kernel's body, as Triton source lines (template.py says what runs).

Kernel variables the emitter indexes with (so operands are read through their views):
`bb` batch row, `hk` / `hv` key / value head, `nn` sequence (scalars); in a chunk `tt`
[CHUNK, 1] and `tc` [CHUNK] time, `ek` [1, KP] key feature, `ev` [1, BV] value column;
in a decode step `ts` time (scalar), `kk` [KP], `vv` [BV]; the state block at `kr`
[KP, 1] by `ev`.
"""

from __future__ import annotations

import torch

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.indexing import Lin, Var
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, mask_of
from kiln.codegen.templates.gated_delta.analysis import DeltaShape, pow2
from kiln.codegen.templates.matmul.template import dot_operand

_TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}


def _v(name: str, size, block: bool = True) -> Lin:
    return Lin.of(Var(name, size, block))


def body(em: Emitter, p: SymbolicArgs, s: DeltaShape) -> list[str]:
    kp = pow2(s.key_dim)
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    L = [
        "pid_v = tl.program_id(0)",
        f"hv = tl.program_id(1){wide}",
        f"nn = tl.program_id(2){wide}",
        f"hk = hv // {s.group}",
        f"kk = tl.arange(0, {kp})",
        "kr = kk[:, None]",
        "ek = kk[None, :]",
        f"vv = pid_v * BV + tl.arange(0, BV){wide}",
        "ev = vv[None, :]",
        f"s_ok = (kr < {s.key_dim}) & (ev < {s.value_dim})",
    ]
    if s.cu_seqlens is not None:
        n = _v("nn", s.sequences, False)
        L += _scalar(em, "bos", s.cu_seqlens, (n,), wide)
        L += _scalar(em, "eos", s.cu_seqlens, (n + 1,), wide)
        L.append("bb = 0")
    else:
        L += ["bos = 0", f"eos = {p.dim(s.seq)}", "bb = nn"]
    state_at = (_v("nn", s.sequences, False), _v("hv", s.value_heads, False),
                _v("kr", s.key_dim), _v("ev", s.value_dim))
    if s.initial_state is not None:
        with em.block() as lines:
            v = em.value(s.initial_state, state_at, mask_of(Cond("s_ok", frozenset({"kr", "ev"}))))
        L += lines + [f"S = tl.where(s_ok, tl.zeros([{kp}, BV], tl.float32) + "
                      f"{v.code}.to(tl.float32), 0.0)"]
    else:
        L.append(f"S = tl.zeros([{kp}, BV], tl.float32)")
    t = s.static_t
    if t == 1:
        L += _decode(em, s, kp)
    elif t is not None:
        L += _chunks(em, s, kp)
    else:
        L += ["if eos - bos == 1:", *_indent(_decode(em, s, kp)),
              "else:", *_indent(_chunks(em, s, kp))]
    if s.final_state is not None:
        with em.block() as lines:
            em.store(s.final_state, state_at, em.let("S", torch.float32, frozenset({"kr", "ev"})),
                     mask_of(Cond("s_ok", frozenset({"kr", "ev"}))))
        L += lines
    return L


def _indent(lines: list[str]) -> list[str]:
    return ["    " + x for x in lines]


def _scalar(em: Emitter, name: str, value: str, index, wide: str) -> list[str]:
    with em.block() as lines:
        v = em.value(value, index)
    return lines + [f"{name} = {v.code}.to({'tl.int64' if wide else 'tl.int32'})"]


def _load(em: Emitter, s: DeltaShape, which: str, index, mask, target: str, tile: str,
          ok: str, dtype: str = "tl.float32") -> list[str]:
    """`target = ` operand `which` at `index` as a full `tile` of `dtype`, zero where not
    `ok` (lanes a fused prologue computed from masked loads)."""
    with em.block() as lines:
        v = em.value(which, index, mask)
    return lines + [f"{target} = tl.where({ok}, tl.zeros({tile}, {dtype}) + "
                    f"{v.code}.to({dtype}), 0.0).to({dtype})"]


def _operands(em: Emitter, s: DeltaShape, t: Lin, keys: Lin, values: Lin, kc: Cond,
              vc: Cond, tc: Cond | None, tile_k: str, tile_v: str, tile_t: str,
              t_ok: str, k_ok: str, v_ok: str, tv: Lin, tvc: Cond | None) -> list[str]:
    """The lines loading q, k, v ([T, K or BV] tiles at time `t`) and g, beta (a [T]
    vector at time `tv`), in fp32, zero outside the valid lanes."""
    b, hk, hv = _v("bb", s.batch, False), _v("hk", s.heads, False), _v("hv", s.value_heads,
                                                                      False)
    dt = _TL[s.dtype]  # q and k stay in their dtype: [CHUNK, K] tiles are the largest
    return [
        *_load(em, s, s.q, (b, t, hk, keys), mask_of(tc, kc), "q", tile_k, k_ok, dt),
        *_load(em, s, s.k, (b, t, hk, keys), mask_of(tc, kc), "k", tile_k, k_ok, dt),
        *_load(em, s, s.v, (b, t, hv, values), mask_of(tc, vc), "v", tile_v, v_ok),
        *_load(em, s, s.g, (b, tv, hv), mask_of(tvc), "g", tile_t, t_ok),
        *_load(em, s, s.beta, (b, tv, hv), mask_of(tvc), "beta", tile_t, t_ok),
    ]


def _decode(em: Emitter, s: DeltaShape, kp: int) -> list[str]:
    """One step straight from the recurrence; the state block stays in registers."""
    ts = _v("ts", s.seq, False)
    kc = Cond(f"kk < {s.key_dim}", frozenset({"kk"}))
    vc = Cond(f"vv < {s.value_dim}", frozenset({"vv"}))
    L = ["ts = bos"]
    L += _operands(em, s, ts, _v("kk", s.key_dim), _v("vv", s.value_dim), kc, vc, None,
                   f"[{kp}]", "[BV]", "[]", "True", kc.code, vc.code, ts, None)
    L += [
        f"q = q.to(tl.float32) * {s.scale!r}",
        "k = k.to(tl.float32)",
        "S = S * tl.exp(g)",
        "u = beta * (v - tl.sum(k[:, None] * S, 0))",
        "S = S + k[:, None] * u[None, :]",
        "o = tl.sum(q[:, None] * S, 0)",
    ]
    if s.out is not None:
        b, hv = _v("bb", s.batch, False), _v("hv", s.value_heads, False)
        with em.block() as lines:
            em.store(s.out, (b, ts, hv, _v("vv", s.value_dim)),
                     em.let("o", torch.float32, frozenset({"vv"})), mask_of(vc))
        L += lines
    return L


def _chunks(em: Emitter, s: DeltaShape, kp: int) -> list[str]:
    """The chunk loop: per chunk the intra-chunk solve, the outputs, the state update."""
    dt = _TL[s.dtype]
    ieee = ', input_precision="ieee"' if s.dtype == torch.float32 else ""

    def dot(a: str, b: str) -> str:
        a, b = (dot_operand(f"({x}).to({dt})", s.dtype, em.target) for x in (a, b))
        return f"tl.dot({a}, {b}{ieee}, out_dtype=tl.float32)"

    tt, tcv = _v("tt", s.seq), _v("tc", s.seq)
    tc = Cond("t_ok", frozenset({"tt"}))
    kc = Cond(f"ek < {s.key_dim}", frozenset({"ek"}))
    vc = Cond(f"ev < {s.value_dim}", frozenset({"ev"}))
    loads = _operands(em, s, tt, _v("ek", s.key_dim), _v("ev", s.value_dim), kc, vc, tc,
                      f"[CHUNK, {kp}]", "[CHUNK, BV]", "[CHUNK]", "tc_ok",
                      f"t_ok & (ek < {s.key_dim})", f"t_ok & (ev < {s.value_dim})", tcv,
                      Cond("tc_ok", frozenset({"tc"})))
    L = [
        "rows = tl.arange(0, CHUNK)",
        "causal = rows[:, None] >= rows[None, :]",
        "strict = rows[:, None] > rows[None, :]",
        "eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)",
        "for c0 in range(bos, eos, CHUNK):",
        *_indent([
            "tc = c0 + rows",
            "tt = tc[:, None]",
            "tc_ok = tc < eos",
            "t_ok = tt < eos",
            *loads,
            # G_i: log decay from the chunk's start through step i (the tail adds g = 0)
            "G = tl.cumsum(g, 0)",
            'decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))',
            f"A = tl.where(strict, beta[:, None] * {dot('k', 'tl.trans(k)')} * decay, 0.0)",
            # (I + A)^-1 by forward substitution: row i = e_i - sum_{j<i} A_ij row_j
            "At = tl.trans(A)",
            "Ti = eye",
            "for i in range(1, CHUNK):",
            "    a_i = tl.sum(tl.where(rows[None, :] == i, At, 0.0), 1)",
            "    Ti = Ti - tl.where(rows[:, None] == i, tl.sum(a_i[:, None] * Ti, 0)[None, :], "
            "0.0)",
            "eG = tl.exp(G)",
            f"U = {dot('Ti', 'beta[:, None] * (v - eG[:, None] * ' + dot('k', 'S') + ')')}",
            f"q = q.to(tl.float32) * {s.scale!r}",
            f"scores = {dot('q', 'tl.trans(k)')} * decay",
            f"o = {dot('q * eG[:, None]', 'S')} + {dot('scores', 'U')}",
            "G_end = tl.sum(tl.where(rows == CHUNK - 1, G, 0.0), 0)",
            "k_end = k.to(tl.float32) * tl.exp(G_end - G)[:, None]",
            f"S = S * tl.exp(G_end) + {dot('tl.trans(k_end)', 'U')}",
        ]),
    ]
    if s.out is not None:
        b, hv = _v("bb", s.batch, False), _v("hv", s.value_heads, False)
        with em.block() as lines:
            em.store(s.out, (b, tt, hv, _v("ev", s.value_dim)),
                     em.let("o", torch.float32, frozenset({"tt", "ev"})), mask_of(tc, vc))
        L += _indent(lines)
    return L
