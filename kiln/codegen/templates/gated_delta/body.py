"""The gated delta rule kernel's pieces, as Triton source lines (template.py says what runs).

Kernel variables the emitter indexes with (so operands are read through their views):
`bb` batch row, `hk` / `hv` key / value head, `nn` sequence (scalars); in a chunk `tt`
[CHUNK, 1] and `tc` [CHUNK] time, `ek` [1, KP] key feature, `ev` [1, BV or VP] value
column; in a decode step `ts` time (scalar), `kk` [KP], `vv` [BV]; the state block at
`kr` [KP, 1] by `ev`.

Scratch (chunked kernel): `gd_ctr` three int32 counters (tickets taken, prepared
chunks, programs done; zero between launches), and per (token, value head) row the
prepared chunk: `gd_w` W [KP], `gd_u` U0 [VP], `gd_a` the causal q.k decay scores
[CHUNK] (all in q's dtype) and `gd_g` the chunk-local cumulative gate (fp32); the
staged form adds its own (staged.py). launch.py puts the roles into one launch.
"""

from __future__ import annotations

import torch

from kiln.codegen.build.interpreter import INDEX_CHECK
from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.indexing import Lin, Var
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.expr.values import Cond, Val, mask_of
from kiln.codegen.templates import load_order
from kiln.codegen.templates.gated_delta.analysis import OP, DeltaShape, pow2
from kiln.codegen.templates.gated_delta.step_fusion import (
    StateReads,
    output_of_step,
    reductions,
    split_ops,
    store_final,
)
from kiln.codegen.templates.matmul.template import dot_operand

TL = {torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16", torch.float32: "tl.float32"}
SCRATCH = ("gd_ctr", "gd_w", "gd_u", "gd_a", "gd_g")
EPILOGUE = ("gd_o", "gd_arrived")  # a decode step's o blocks and a counter per head
_DOUBLINGS = (2, 4, 8, 16, 32)  # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...: CHUNK <= 64
KB = 64  # key / value columns per block in the chunked kernel


def lin(name: str, size, block: bool = True) -> Lin:
    return Lin.of(Var(name, size, block))


def indent(lines: list[str], n: int = 1) -> list[str]:
    return ["    " * n + x for x in lines]


def decode_body(em: Emitter, p: SymbolicArgs, s: DeltaShape) -> list[str]:
    """A static one-step op: a program per (sequence, value head, BV columns) takes
    the recurrence directly; grid (cdiv(V, BV), HV, N). Its region may hold a fused
    prologue and the state's in-place write (step_fusion.py)."""
    kp = pow2(s.key_dim)
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    L = ["vb = tl.program_id(0)", f"hv = tl.program_id(1){wide}",
         f"nn = tl.program_id(2){wide}"]
    L += program(em, p, s, kp, wide)
    reads = None
    if s.final_store is not None:
        reads = StateReads(s.final_store.dest, _STATE_MASK)
        reads.install(em)
    prologue, epilogue = split_ops(em.region, em.region.anchor().name)
    reductions(em, {s.key_dim: ("kk", kp, _key_lanes(s))}, prologue)
    reductions(em, {s.value_dim: ("vh", pow2(s.value_dim), _head_lanes(s))}, epilogue)
    L += _initial_state(em, s, kp)
    L += _decode(em, s, kp)
    # the operands' loads issued up front: emitted where first needed, the k, v and gate
    # loads each waited behind the reductions (l2norms) before them; the epilogue's
    # stay where they are (loaded early, they held registers across the recurrence)
    return load_order.loads_first(L) + _final_state(em, s, reads) + _epilogue(em, s, wide)


def _value_lanes(s: DeltaShape) -> Cond:
    return Cond(f"vv < {s.value_dim}", frozenset({"vv"}))


def _head_lanes(s: DeltaShape) -> Cond:
    return Cond(f"vh < {s.value_dim}", frozenset({"vh"}))


def _epilogue(em: Emitter, s: DeltaShape, wide: str) -> list[str]:
    """The region's outputs computed from o (a gated RMSNorm over each value head,
    step_fusion.py), over a whole head's lanes `vh` and its output `o_h`. With the
    head's columns split over programs (BV < V) each stores its o block to EPILOGUE's
    scratch and counts its arrival on the head's counter; the last to arrive reads the
    whole head back and alone runs the epilogue (kiln.codegen.templates.split_k's way):
    a 128 x 128 fp32 state block on one program's 4 warps left 100 of an H200's 132 SMs
    idle at Qwen3-Next's 32 value heads."""
    if not s.epilogue:
        return []
    vp = pow2(s.value_dim)
    parts, counts = EPILOGUE
    b, _, hv = head_vars(s)
    at = (b, lin("ts", s.seq, False), hv, lin("vh", s.value_dim))  # where o is stored
    output_of_step(em, s.out_op, at, Val("o_h", torch.float32, frozenset({"vh"})))
    with em.block() as lines:
        for name in s.epilogue:
            em.store(name, at, em.value(name, at, mask_of(_head_lanes(s))),
                     mask_of(_head_lanes(s)))
    row = f"(nn * {s.value_heads} + hv)"
    return [
        f"if BV < {vp}:",
        f"    tl.store({parts} + {row} * {vp} + vv, o, mask=vv < {s.value_dim})",
        "    tl.debug_barrier()  # this CTA's block is stored before it is counted",
        f'    arrived = tl.atomic_add({counts} + {row}, 1, sem="acq_rel")',
        f"    last = arrived == tl.cdiv({s.value_dim}, BV) - 1",
        "else:",
        "    last = vb == 0",
        "if last:",
        f"    vh = tl.arange(0, {vp}){wide}",
        f"    if BV < {vp}:  # L2, where the other programs' stores are",
        f"        o_h = tl.load({parts} + {row} * {vp} + vh, mask=vh < {s.value_dim}, "
        'other=0.0, cache_modifier=".cg")',
        f"        tl.store({counts} + {row}, 0)  # zero again for the next launch",
        "    else:",
        "        o_h = o",
        *indent(lines),
    ]


def program(em: Emitter, p: SymbolicArgs, s: DeltaShape, kp: int, wide: str) -> list[str]:
    """Lines naming the program's head, columns and sequence bounds (hv, nn, vb set)."""
    L = [
        f"hk = hv // {s.group}",
        f"kk = tl.arange(0, {kp})",
        "kr = kk[:, None]",
        "ek = kk[None, :]",
        f"vv = vb * BV + tl.arange(0, BV){wide}",
        "ev = vv[None, :]",
        f"s_ok = (kr < {s.key_dim}) & (ev < {s.value_dim})",
    ]
    if s.cu_seqlens is not None:
        n = lin("nn", s.sequences, False)
        L += _scalar(em, "bos", s.cu_seqlens, (n,), wide)
        L += _scalar(em, "eos", s.cu_seqlens, (n + 1,), wide)
        L += _sequence_bounds_kept(em, p.dim(s.seq))
        L.append("bb = 0")
    else:
        L += ["bos = 0", f"eos = {p.dim(s.seq)}", "bb = nn"]
    return L


_STATE_MASK = mask_of(Cond("s_ok", frozenset({"kr", "ev"})))


def _state_at(s: DeltaShape):
    return (lin("nn", s.sequences, False), lin("hv", s.value_heads, False),
            lin("kr", s.key_dim), lin("ev", s.value_dim))


def _initial_state(em: Emitter, s: DeltaShape, kp: int) -> list[str]:
    if s.initial_state is None:
        return [f"S = tl.zeros([{kp}, BV], tl.float32)"]
    with em.block() as lines:
        v = em.value(s.initial_state, _state_at(s),
                     mask_of(Cond("s_ok", frozenset({"kr", "ev"}))))
    return lines + [f"S = tl.where(s_ok, tl.zeros([{kp}, BV], tl.float32) + "
                    f"{v.code}.to(tl.float32), 0.0)"]


def _final_state(em: Emitter, s: DeltaShape, reads: StateReads | None) -> list[str]:
    S = Val("S", torch.float32, frozenset({"kr", "ev"}))
    with em.block() as lines:
        if s.final_store is not None:
            store_final(em, s.final_store, s.final_op, _state_at(s), S, _STATE_MASK, reads)
        if s.final_state is not None:
            em.store(s.final_state, _state_at(s), S, _STATE_MASK)
    return lines


def _sequence_bounds_kept(em: Emitter, total: str) -> list[str]:
    """cu_seqlens as given: 0 <= bos <= eos <= T is checked on the interpret target (its
    reads past T are raw host memory: build/interpreter.py) and clamped into [0, T] on
    every target, so bad bounds read and write only the op's own tensors and scratch (a
    check on a GPU would cost a host sync a call; the CPU target's torch form raises)."""
    L = []
    if em.target.backend == "interpret":
        L.append(f'tl.device_assert((bos >= 0) & (bos <= eos) & (eos <= {total}), '
                 f'"{INDEX_CHECK} ({OP})")')
    return L + [f"bos = tl.minimum(tl.maximum(bos, 0), {total})",
                f"eos = tl.minimum(tl.maximum(eos, bos), {total})"]


def _scalar(em: Emitter, name: str, value: str, index, wide: str) -> list[str]:
    with em.block() as lines:
        v = em.value(value, index)
    return lines + [f"{name} = {v.code}.to({'tl.int64' if wide else 'tl.int32'})"]


def load_tile(em: Emitter, which: str, index, mask, target: str, tile: str, ok: str,
          dtype: str = "tl.float32") -> list[str]:
    """`target = ` operand `which` at `index` as a full `tile` of `dtype`, zero where not
    `ok` (lanes a fused prologue computed from masked loads)."""
    with em.block() as lines:
        v = em.value(which, index, mask)
    if _whole_masked_load(lines, v, mask, tile):  # zero where not ok already: no select
        return lines + [f"{target} = {v.code}.to({dtype})"]
    return lines + [f"{target} = tl.where({ok}, tl.zeros({tile}, {dtype}) + "
                    f"{v.code}.to({dtype}), 0.0).to({dtype})"]


def _whole_masked_load(lines: list[str], v, mask, tile: str) -> bool:
    """Whether `v` is one fresh load of the whole tile under every condition of `mask`
    (em.load masks with the conditions over its offset's variables, other=0)."""
    conds = frozenset(mask or ())
    return (len(lines) == 1 and lines[0].startswith(f"{v.code} = tl.load(")
            and ", other=0)" in lines[0] and len(v.vars) == tile.count(",") + 1
            and all(c.vars <= v.vars for c in conds))


def head_vars(s: DeltaShape):
    return lin("bb", s.batch, False), lin("hk", s.heads, False), lin("hv", s.value_heads, False)


def _key_lanes(s: DeltaShape) -> Cond:
    return Cond(f"kk < {s.key_dim}", frozenset({"kk"}))


def _decode(em: Emitter, s: DeltaShape, kp: int) -> list[str]:
    """One step straight from the recurrence; the state block stays in registers."""
    ts = lin("ts", s.seq, False)
    b, hk, hv = head_vars(s)
    kc, vc = _key_lanes(s), _value_lanes(s)
    keys, values = lin("kk", s.key_dim), lin("vv", s.value_dim)
    dt = TL[s.dtype]
    L = ["ts = bos"]
    L += load_tile(em, s.q, (b, ts, hk, keys), mask_of(kc), "q", f"[{kp}]", kc.code, dt)
    L += load_tile(em, s.k, (b, ts, hk, keys), mask_of(kc), "k", f"[{kp}]", kc.code, dt)
    L += load_tile(em, s.v, (b, ts, hv, values), mask_of(vc), "v", "[BV]", vc.code)
    L += load_tile(em, s.g, (b, ts, hv), None, "g", "[]", "True")
    L += load_tile(em, s.beta, (b, ts, hv), None, "beta", "[]", "True")
    L += [
        f"q = q.to(tl.float32) * {s.scale!r}",
        "k = k.to(tl.float32)",
        "S = S * tl.exp(g)",
        "u = beta * (v - tl.sum(k[:, None] * S, 0))",
        "S = S + k[:, None] * u[None, :]",
        "o = tl.sum(q[:, None] * S, 0)",
    ]
    if s.out is not None:
        with em.block() as lines:
            em.store(s.out, (b, ts, hv, values), em.let("o", torch.float32, frozenset({"vv"})),
                     mask_of(vc))
        L += lines
    return L


def dots(em: Emitter, s: DeltaShape):
    """(dot in q's dtype with fp32 accumulation, dot of fp32 operands)."""
    dt = TL[s.dtype]
    ieee = s.dtype == torch.float32
    prec = ', input_precision="ieee"' if ieee else ""

    def dot(a: str, b: str) -> str:
        a, b = (dot_operand(f"({x}).to({dt})", s.dtype, em.target) for x in (a, b))
        return f"tl.dot({a}, {b}{prec}, out_dtype=tl.float32)"

    def fdot(a: str, b: str) -> str:  # the solve: fp32 (tf32 on tensor cores for 16-bit)
        return f"tl.dot({a}, {b}{prec}, out_dtype=tl.float32)"

    return dot, fdot


def chunk_rows(s: DeltaShape, tokens: str) -> list[str]:
    """Lines naming a chunk's steps from c0: tc, tt, their masks, and the scratch row of
    each step (its token's row for this value head)."""
    return ["tc = c0 + rows", "tt = tc[:, None]", "tc_ok = tc < eos", "t_ok = tt < eos",
            f"row = ({tokens}).to(tl.int64) * {s.value_heads} + hv", "rr = row[:, None]"]


def blocks_of(n: int) -> list[int]:
    """Block starts splitting a padded width `n` into KB-wide blocks."""
    return list(range(0, n, min(KB, n)))


def prep(em: Emitter, s: DeltaShape, kp: int, vp: int, tokens: str) -> list[str]:
    """One chunk's preparation (no state needed), stored to scratch. Keys and values
    are taken KB columns at a time: whole [CHUNK, 256] tiles spilled registers; the
    keys are read twice (for the products, then for W) rather than held over the solve,
    which took all 255 registers at CHUNK 64 on 8 warps (sm_90, K = 256)."""
    dot, fdot = dots(em, s)
    dt = TL[s.dtype]
    b, hk, hv = head_vars(s)
    tt, tc = lin("tt", s.seq), lin("tc", s.seq)
    tcond, tvc = Cond("t_ok", frozenset({"tt"})), Cond("tc_ok", frozenset({"tc"}))
    L = [*chunk_rows(s, tokens)]
    L += load_tile(em, s.g, (b, tc, hv), mask_of(tvc), "g", "[CHUNK]", "tc_ok")
    L += load_tile(em, s.beta, (b, tc, hv), mask_of(tvc), "beta", "[CHUNK]", "tc_ok")
    L += ["G = tl.cumsum(g, 0)  # log decay from the chunk's start (the tail adds g = 0)",
          'decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], float("-inf")))',
          "eG = tl.exp(G)"]
    kw = min(KB, kp)
    for i, k0 in enumerate(blocks_of(kp)):
        e = f"ek{i}"
        kc = Cond(f"{e} < {s.key_dim}", frozenset({e}))
        ok = f"t_ok & ({e} < {s.key_dim})"
        L.append(f"{e} = {k0} + tl.arange(0, {kw})[None, :]")
        L += load_tile(em, s.q, (b, tt, hk, lin(e, s.key_dim)), mask_of(tcond, kc), f"q{i}",
                   f"[CHUNK, {kw}]", ok, dt)
        L += load_tile(em, s.k, (b, tt, hk, lin(e, s.key_dim)), mask_of(tcond, kc), f"k{i}",
                   f"[CHUNK, {kw}]", ok, dt)
        first = i == 0
        L += [f"kkt = {'' if first else 'kkt + '}{dot(f'k{i}', f'tl.trans(k{i})')}",
              f"qkt = {'' if first else 'qkt + '}{dot(f'q{i}', f'tl.trans(k{i})')}"]
    L += [  # the scores are stored first: q.k and the decay are dead before the solve
        f"Aqk = tl.where(causal, qkt * decay, 0.0) * {s.scale!r}",
        f"tl.store(gd_a + rr * CHUNK + rows[None, :], Aqk.to({dt}), mask=t_ok)",
        "tl.store(gd_g + row, G, mask=tc_ok)",
        "N = -tl.where(strict, beta[:, None] * kkt * decay, 0.0)",
        "Ti = eye + N  # (I - N)^-1 = (I + N)(I + N^2)(I + N^4)...: N^CHUNK = 0",
        "P = N",
    ]
    for d in _DOUBLINGS:
        L += [f"if CHUNK > {d}:", f"    P = {fdot('P', 'P')}", f"    Ti = Ti + {fdot('Ti', 'P')}"]
    # W = Ti diag(beta exp(G)) k and U0 = Ti diag(beta) v: Ti's columns scaled once,
    # not every key and value block's rows (each an fp32 round trip of the block)
    L += [f"Tw = (Ti * (beta * eG)[None, :]).to({dt})", f"Tu = (Ti * beta[None, :]).to({dt})"]
    for i in range(len(blocks_of(kp))):  # keys read again (L2), not held over the solve
        e = f"ek{i}"
        kc = Cond(f"{e} < {s.key_dim}", frozenset({e}))
        L += load_tile(em, s.k, (b, tt, hk, lin(e, s.key_dim)), mask_of(tcond, kc), "kb",
                   f"[CHUNK, {kw}]", f"t_ok & ({e} < {s.key_dim})", dt)
        L += [f"W = {dot('Tw', 'kb')}",
              f"tl.store(gd_w + rr * {kp} + {e}, W.to({dt}), mask=t_ok)"]
    vw = min(KB, vp)
    for i, v0 in enumerate(blocks_of(vp)):
        e = f"ew{i}"
        vc = Cond(f"{e} < {s.value_dim}", frozenset({e}))
        L.append(f"{e} = {v0} + tl.arange(0, {vw})[None, :]")
        L += load_tile(em, s.v, (b, tt, hv, lin(e, s.value_dim)), mask_of(tcond, vc), "v",
                   f"[CHUNK, {vw}]", f"t_ok & ({e} < {s.value_dim})", dt)
        L += [f"U = {dot('Tu', 'v')}",
              f"tl.store(gd_u + rr * {vp} + {e}, U.to({dt}), mask=t_ok)"]
    return L


def walk(em: Emitter, s: DeltaShape, kp: int, vp: int, tokens: str) -> list[str]:
    """The chunk loop of a walker: per chunk U = U0 - W S, the outputs, the state. The
    state is held as KB-row blocks S0, S1, ... (as the keys are read)."""
    dot, _ = dots(em, s)
    dt = TL[s.dtype]
    b, hk, hv = head_vars(s)
    tt = lin("tt", s.seq)
    tcond = Cond("t_ok", frozenset({"tt"}))
    vc = Cond(f"ev < {s.value_dim}", frozenset({"ev"}))
    cg = 'cache_modifier=".cg"'  # written by other programs of this launch: read L2
    kw = min(KB, kp)
    blocks = range(len(blocks_of(kp)))
    inner = [*chunk_rows(s, tokens)]
    inner += [
        f"U = tl.load(gd_u + rr * {vp} + ev, mask=t_ok & (ev < {s.value_dim}), other=0.0, "
        f"{cg}).to(tl.float32)",
        f"Aqk = tl.load(gd_a + rr * CHUNK + rows[None, :], mask=t_ok, other=0.0, {cg})",
        f"G = tl.load(gd_g + row, mask=tc_ok, other=0.0, {cg})",
        "last = tl.minimum(eos - c0, CHUNK) - 1",
        "G_end = tl.sum(tl.where(rows == last, G, 0.0), 0)",
        f"qs = tl.exp(G) * {s.scale!r}",
        "ks = tl.exp(G_end - G)",
    ]
    for i in blocks:
        e = f"ek{i}"
        kc = Cond(f"{e} < {s.key_dim}", frozenset({e}))
        inner += [f"W{i} = tl.load(gd_w + rr * {kp} + {e}, mask=t_ok, other=0.0, {cg})",
                  f"Sd{i} = S{i}.to({dt})"]
        inner += load_tile(em, s.q, (b, tt, hk, lin(e, s.key_dim)), mask_of(tcond, kc), f"q{i}",
                       f"[CHUNK, {kw}]", f"t_ok & ({e} < {s.key_dim})", dt)
        inner += [f"WS = {'' if i == 0 else 'WS + '}{dot(f'W{i}', f'Sd{i}')}",
                  f"o = {'' if i == 0 else 'o + '}{dot(f'q{i}', f'Sd{i}')}"]
    # q's rows and U's rows (for the state) scaled once, not each key block; the keys
    # read transposed ([KB, CHUNK]): no fp32 round trip or transpose of k a block
    inner += ["U = U - WS", f"o = o * qs[:, None] + {dot('Aqk', 'U')}",
              f"Uk = (U * ks[:, None]).to({dt})", *transposed_keys(em, s, kp)]
    for i in blocks:
        inner += [f"S{i} = {dot(f'kt{i}', 'Uk')[:-1]}, acc=S{i} * tl.exp(G_end))"]
    if s.out is not None:
        with em.block() as lines:
            em.store(s.out, (b, tt, hv, lin("ev", s.value_dim)),
                     em.let("o", torch.float32, frozenset({"tt", "ev"})), mask_of(tcond, vc))
        inner += lines
    head = [f"ek{i} = {k0} + tl.arange(0, {kw})[None, :]" for i, k0 in enumerate(blocks_of(kp))]
    return head + ["for c0 in range(bos, eos, CHUNK):", *indent(inner)]


def transposed_keys(em: Emitter, s: DeltaShape, kp: int) -> list[str]:
    """A chunk's keys as [KB, CHUNK] blocks kt0, kt1, ... (the k^T U products' operands),
    every block's load issued before any is used."""
    b, hk, _ = head_vars(s)
    kw = min(KB, kp)
    L = ["ttk = tc[None, :]", "tk_ok = ttk < eos"]
    ttk, tk = lin("ttk", s.seq), Cond("tk_ok", frozenset({"ttk"}))
    for i in range(len(blocks_of(kp))):
        r = f"kr{i}"
        kc = Cond(f"{r} < {s.key_dim}", frozenset({r}))
        L += load_tile(em, s.k, (b, ttk, hk, lin(r, s.key_dim)), mask_of(tk, kc), f"kt{i}",
                       f"[{kw}, CHUNK]", f"tk_ok & ({r} < {s.key_dim})", TL[s.dtype])
    return L


def state_blocks(em: Emitter, s: DeltaShape, kp: int, final: bool) -> list[str]:
    """The chunked kernel's state as KB-row blocks: loaded (S0 = ...) or stored."""
    kw = min(KB, kp)
    L = []
    for i, k0 in enumerate(blocks_of(kp)):
        r, ok = f"kr{i}", f"s_ok{i}"
        L += [f"{r} = {k0} + tl.arange(0, {kw})[:, None]",
              f"{ok} = ({r} < {s.key_dim}) & (ev < {s.value_dim})"]
        at = (lin("nn", s.sequences, False), lin("hv", s.value_heads, False),
              lin(r, s.key_dim), lin("ev", s.value_dim))
        mask = mask_of(Cond(ok, frozenset({r, "ev"})))
        with em.block() as lines:
            if final:
                em.store(s.final_state, at, em.let(f"S{i}", torch.float32,
                                                   frozenset({r, "ev"})), mask)
            elif s.initial_state is not None:
                v = em.value(s.initial_state, at, mask)
                lines.append(f"S{i} = tl.where({ok}, tl.zeros([{kw}, BV], tl.float32) + "
                             f"{v.code}.to(tl.float32), 0.0)")
            else:
                lines.append(f"S{i} = tl.zeros([{kw}, BV], tl.float32)")
        L += lines
    return L
