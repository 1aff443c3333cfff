"""The chunked kernel's one launch: its roles, told apart by tickets (template.py's form).

Each program takes a ticket from an atomic counter. A ticket is taken when its program
runs, so every program one waits for holds an earlier ticket and is already running:
no deadlock, whatever order the GPU schedules programs in. Tickets in order:

- preparers, one per (sequence, chunk, value head), all in parallel (body.prep): the
  gate's cumulative sum, (I + A)^-1 by doubling, W, U0 and the causal scores to scratch;
- walkers, one per (sequence, value head, BV columns), once every chunk is prepared,
  walk the chunks with the fp32 state block in registers. With STAGED = 0 (the one-pass
  form, body.walk) a walker also writes each chunk's outputs; with STAGED = 1
  (staged.walk_states) it only stores each chunk's state and effective values and
  counts the chunk done;
- with STAGED = 1, output programs, one per (chunk, sequence, value head, BV columns),
  chunk-major so the earliest chunks run first (staged.outputs), each as soon as its
  walker has passed its chunk.

The last program to finish zeroes the counters and flags for the next launch.
"""

from __future__ import annotations

from kiln.codegen.expr.emit import Emitter
from kiln.codegen.expr.kernel_args import SymbolicArgs
from kiln.codegen.templates.gated_delta import staged
from kiln.codegen.templates.gated_delta.analysis import DeltaShape, pow2
from kiln.codegen.templates.gated_delta.body import (
    SCRATCH,
    indent,
    prep,
    program,
    state_blocks,
    walk,
)

COUNTERS = SCRATCH[0]  # int32: tickets taken, prepared chunks, programs done


def chunked_body(em: Emitter, p: SymbolicArgs, s: DeltaShape) -> list[str]:
    """The chunked kernel's lines: a 1-d grid of preparers, walkers and (STAGED) output
    programs, in ticket order."""
    kp, vp = pow2(s.key_dim), pow2(s.value_dim)
    wide = ".to(tl.int64)" if p.needs_int64 else ""
    tokens = "tc" if s.cu_seqlens is not None else f"bb * {p.dim(s.seq)} + tc"
    hv_n, seqs = s.value_heads, p.dim(s.sequences)
    nj = f"tl.cdiv({p.dim(s.seq)}, CHUNK)"
    nvb = f"tl.cdiv({s.value_dim}, BV)"
    L = [
        f"ticket = tl.atomic_add({COUNTERS}, 1)",
        f"n_prep = {hv_n} * {seqs} * {nj}",
        f"n_walk = {hv_n} * {seqs} * {nvb}",
        "n_out = n_prep * " + nvb + " if STAGED else 0",
        "rows = tl.arange(0, CHUNK)",
        "if ticket < n_prep:",
        # the preparers' [CHUNK, CHUNK] masks: made before the branch they held
        # registers in every role
        *indent(["causal = rows[:, None] >= rows[None, :]",
                  "strict = rows[:, None] > rows[None, :]",
                  "eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)",
                  f"hv = (ticket % {hv_n}){wide}",
                  f"jj = (ticket // {hv_n}) % {nj}",
                  f"nn = (ticket // {hv_n} // {nj}){wide}",
                  "vb = 0",
                  *program(em, p, s, kp, wide),
                  "c0 = bos + jj * CHUNK",
                  "if c0 < eos:",
                  *indent(prep(em, s, kp, vp, tokens)),
                  "tl.debug_barrier()  # the CTA's stores land before it is counted",
                  f'tl.atomic_add({COUNTERS} + 1, 1, sem="release")']),
        "elif ticket < n_prep + n_walk:",
        *indent([
            "walker = ticket - n_prep",
            f"vb = walker % {nvb}",
            f"hv = ((walker // {nvb}) % {hv_n}){wide}",
            f"nn = (walker // {nvb} // {hv_n}){wide}",
            *program(em, p, s, kp, wide),
            f'while tl.atomic_add({COUNTERS} + 1, 0, sem="acquire") < n_prep:',
            "    pass",
            "if STAGED:",
            *indent(staged.walk_states(em, p, s, kp, vp, tokens)),
            "else:",
            *indent([*state_blocks(em, s, kp, final=False), *walk(em, s, kp, vp, tokens),
                     *(state_blocks(em, s, kp, final=True) if s.final_state else [])])]),
        "else:",
        *indent(["if STAGED:", *indent([
            "part = ticket - n_prep - n_walk",
            f"vb = part % {nvb}",
            f"hv = ((part // {nvb}) % {hv_n}){wide}",
            f"nn = ((part // {nvb} // {hv_n}) % {seqs}){wide}",
            f"jj = part // {nvb} // {hv_n} // {seqs}",
            *program(em, p, s, kp, wide),
            "c0 = bos + jj * CHUNK",
            "if c0 < eos:",
            *indent(staged.outputs(em, p, s, kp, vp, tokens))])]),
        f'done = tl.atomic_add({COUNTERS} + 2, 1, sem="acq_rel")',
        "if done == n_prep + n_walk + n_out - 1:  # the last program: zero for the next launch",
        f"    tl.store({COUNTERS}, 0)",
        f"    tl.store({COUNTERS} + 1, 0)",
        f"    tl.store({COUNTERS} + 2, 0)",
        "    if STAGED:",
        "        for f0 in range(0, n_walk, 256):",
        "            fl = f0 + tl.arange(0, 256)",
        "            tl.store(gd_flag + fl, 0, mask=fl < n_walk)",
    ]
    return L

