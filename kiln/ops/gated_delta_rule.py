"""The gated delta rule (Gated DeltaNet's linear attention), as one op kiln keeps whole.

Per value head, with a state S of shape [V, K] (stored transposed, [K, V]):

    S_t = S_{t-1} * exp(g_t) * (I - beta_t k_t k_t^T) + beta_t v_t k_t^T
    o_t = S_t (scale * q_t)

flash-linear-attention's layout and meaning: q, k [B, T, H, K]; v [B, T, HV, V] with
HV a multiple of H (value head j reads key head j // (HV // H)); g (log decay) and
beta [B, T, HV]; states [N, HV, K, V] in fp32, N = B, or the number of sequences when
`cu_seqlens` packs N sequences along T of a batch of one.

It is a torch.library custom op (`kiln::gated_delta_rule`) so torch.export keeps it
as one node, like attention: a recurrence unrolled into ATen ops would be T steps of
tiny matmuls no fusion can rescue. The PyTorch implementation below defines it; on
the CPU it is what runs. It is the chunked (WY) form in fp32: inside a chunk of C
steps the recurrence is solved with a unit lower-triangular system and matmuls, and
only the chunk-to-chunk state update is sequential, so a prefill costs T / C steps.

Within a chunk (positions i, j; G_i the cumulative log decay from the chunk start, S0
the state before the chunk), the delta rule's effective values U satisfy

    (I + A) U = beta * V - (beta * exp(G)) * K S0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j, j < i
    O = exp(G) * Q S0 + (exp(G_i - G_j) q_i.k_j, j <= i) U
    S_C = exp(G_C) S0 + (exp(G_C - G_j) k_j)^T U

(I + A)^-1 applied to both right-hand sides does not depend on S0, so it is computed
for every chunk at once; the loop over chunks is three small matmuls each.
"""

from __future__ import annotations

import numbers

import torch

from kiln.errors import ArgumentError, DTypeError, ShapeError

CHUNK = 64  # steps per chunk: the triangular solves cost C^2 per step, the loop T / C


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, *, scale: float | None = None,
                     initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False,
                     cu_seqlens: torch.Tensor | None = None):
    """(o [B, T, HV, V] in v's dtype, final state [N, HV, K, V] fp32 or None).

    scale multiplies q (default K ** -0.5). initial_state (default zeros) is [N, HV, K,
    V]. cu_seqlens [N + 1] (integers, 0 first, T last) packs N sequences along T of a
    batch of one; each starts from its own initial state row.
    """
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise ArgumentError(f"scale must be a number, got {type(scale).__name__} {scale!r}",
                            where="kiln.ops.gated_delta_rule",
                            hint="a Python float that multiplies q; None for K ** -0.5")
    o, state = torch.ops.kiln.gated_delta_rule(q, k, v, g, beta, float(scale),
                                               initial_state, cu_seqlens)
    return o, (state if output_final_state else None)


def _check(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    """Shapes and dtypes a caller can get wrong, said in the op's own terms."""
    where = "kiln.ops.gated_delta_rule"
    for name, t, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3),
                          ("beta", beta, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"{name} must be a {rank}-d tensor, got {got}", where=where,
                             hint="q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if tuple(k.shape) != tuple(q.shape):
        raise ShapeError(f"k has shape {list(k.shape)}, q {list(q.shape)}: they must match",
                         where=where, hint="q and k are both [B, T, H, K]")
    if tuple(v.shape[:2]) != (B, T):
        raise ShapeError(f"v has shape {list(v.shape)}; its batch and time must be q's "
                         f"{[B, T]}", where=where)
    if 0 in (H, K, HV, V):  # nothing to attend with; K ** -0.5 and HV % H divide by it
        raise ShapeError(f"q has shape {list(q.shape)} and v {list(v.shape)}: head counts "
                         "and head dims must be at least 1", where=where)
    if HV % H != 0:
        raise ShapeError(f"v has {HV} heads, not a multiple of q and k's {H}", where=where,
                         hint="each key head serves HV // H value heads")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, HV):
            raise ShapeError(f"{name} has shape {list(t.shape)}, expected {[B, T, HV]}",
                             where=where, hint=f"{name} holds one value per step and value "
                             "head")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.dtype.is_floating_point:
            raise DTypeError(f"{name} has dtype {t.dtype}; it must be floating point",
                             where=where)
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 \
                or cu_seqlens.dtype not in (torch.int32, torch.int64) \
                or cu_seqlens.shape[0] < 1:  # [0] at least: the fake op makes N + 1 - 1 states
            got = (f"{cu_seqlens.dtype} of shape {list(cu_seqlens.shape)}"
                   if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
            raise ArgumentError(f"cu_seqlens must be a non-empty 1-d int32/int64 tensor, got "
                                f"{got}", where=where,
                                hint="torch.tensor([0, len_1, len_1 + len_2, ..., T], "
                                "dtype=torch.int32)")
        if B != 1:
            raise ShapeError(f"with cu_seqlens the batch must be 1 (sequences packed along "
                             f"T), got B = {B}", where=where,
                             hint="concatenate the sequences along T into one row")
        N = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) \
                or not initial_state.dtype.is_floating_point:  # read as fp32: ints would pass
            got = (initial_state.dtype if isinstance(initial_state, torch.Tensor)
                   else type(initial_state).__name__)
            raise DTypeError(f"initial_state must be a floating-point tensor, got {got}",
                             where=where, hint="one fp32 [HV, K, V] state per sequence")
        want = (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            raise ShapeError(f"initial_state has shape {list(initial_state.shape)}, expected "
                             f"{list(want)}", where=where,
                             hint="one [HV, K, V] state per sequence")


# ---- the op ---------------------------------------------------------------------------


@torch.library.custom_op("kiln::gated_delta_rule", mutates_args=())
def _gated_delta_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, scale: float,
                         initial_state: torch.Tensor | None,
                         cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = v.dtype
    # [B, HV, T, ...] fp32; each value head reads its key head.
    q, k = (x.repeat_interleave(HV // H, dim=2) if HV != H else x for x in (q, k))
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    q = q * scale
    if cu_seqlens is None:
        state = _initial(initial_state, B, HV, K, V, q.device)
        o, final = _chunked(q, k, v, g, beta, state)
        return o.transpose(1, 2).to(out_dtype).contiguous(), final
    bounds = _sequence_bounds(cu_seqlens, T)
    state = _initial(initial_state, len(bounds), HV, K, V, q.device)
    o = torch.empty_like(v)
    finals = []
    for n, (s, e) in enumerate(bounds):
        part, final = _chunked(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g[:, :, s:e],
                               beta[:, :, s:e], state[n:n + 1])
        o[:, :, s:e] = part
        finals.append(final)
    final = torch.cat(finals) if finals else state.clone()  # cu_seqlens [0]: no sequences
    return o.transpose(1, 2).to(out_dtype).contiguous(), final


@_gated_delta_rule_op.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    state = q.new_empty((n, v.shape[2], q.shape[3], v.shape[3]), dtype=torch.float32)
    return torch.empty_like(v, memory_format=torch.contiguous_format), state


def _initial(state, n, hv, k, v, device) -> torch.Tensor:
    if state is None:
        return torch.zeros(n, hv, k, v, dtype=torch.float32, device=device)
    return state.float()


def _sequence_bounds(cu_seqlens: torch.Tensor, T: int) -> list[tuple[int, int]]:
    """[(start, end)] per packed sequence; checks what only the values can tell."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ArgumentError(f"cu_seqlens {cu} does not split T = {T} into sequences",
                            where="kiln.ops.gated_delta_rule",
                            hint="cu_seqlens starts at 0, never decreases and ends at T")
    return list(zip(cu, cu[1:]))


def _one_step(q, k, v, g, beta, state):
    """A decode step (T = 1) straight from the recurrence: a chunk's solve would cost
    more small ops than the step itself. Same tensors and result as _chunked."""
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]  # [B, HV, K or V]
    S = state * g[:, :, 0].exp()[..., None, None]
    u = beta[:, :, 0, None] * (v - (k[..., None] * S).sum(-2))
    S = S + k[..., :, None] * u[..., None, :]
    return (q[..., None] * S).sum(-2)[:, :, None], S


def _chunked(q, k, v, g, beta, state):
    """The chunked form on [B, HV, T, .] fp32 tensors; (o [B, HV, T, V], final state)."""
    B, HV, T, K = q.shape
    if T == 1:
        return _one_step(q, k, v, g, beta, state)
    V = v.shape[-1]
    C = max(1, min(CHUNK, T))
    pad = -T % C
    if pad:  # steps with beta = 0 and g = 0 leave the state as it is
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    n = (T + pad) // C
    q, k, v = (x.reshape(B, HV, n, C, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(B, HV, n, C) for x in (g, beta))

    G = g.cumsum(-1)  # log decay from the chunk's start through step i
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i; masked before exp so that j > i cannot overflow
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    A = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    # (I + A)^-1 [beta V, beta exp(G) K] in one solve (A's zero diagonal is read as ones)
    rhs = torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    solved = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    values, keys = solved[..., :V], solved[..., V:]
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * G.exp()[..., None]
    k_to_end = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None, None]

    S = state
    out = torch.empty_like(v)
    for i in range(n):
        U = values[:, :, i] - keys[:, :, i] @ S
        out[:, :, i] = q_decayed[:, :, i] @ S + scores[:, :, i] @ U
        S = S * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ U
    out = out.reshape(B, HV, n * C, V)[:, :, :T]
    return out, S.clone() if S is state else S
