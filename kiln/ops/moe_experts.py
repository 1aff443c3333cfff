"""A mixture of experts' routed SwiGLU experts, as one op kiln keeps whole.

    y[n] = sum_j weights[n, j] * down[e] (silu(gate[e] x[n]) * up[e] x[n]),  e = ids[n, j]

x [N, dim]; weights [N, k] fp32 and ids [N, k] (int32 / int64) are the router's choice
of k experts per token; gate / up [E, I, dim] and down [E, dim, I] are every expert's
weights stacked (DeepSeek-V3: E = 256, k = 8, I = 2048, dim = 7168). A pair whose id
is outside [0, E) contributes nothing (`moe_experts` refuses such ids when it can see
their values; a compiled kernel cannot stop, so it drops them).

How many tokens each expert gets depends on the data, but nothing here has a
data-dependent shape: the N * k (token, expert) pairs are sorted by expert into a row
buffer of static size N * k, so an expert has at most N * k rows (`routing_bound`).
The PyTorch implementation below is that sorted form (and what the CPU target runs):
argsort the pairs by expert, one matmul chain per expert over its contiguous rows,
each pair's weighted output placed at the pair's own row, then every token's k rows
summed in fp32. The generated kernel (kiln.codegen.templates.moe) groups the pairs on
the device and sums each token's rows in the order of j too, so neither result depends
on the order in which the experts are run or finish (no float atomics).

It is a torch.library custom op (`kiln::moe_experts`) so torch.export keeps it as one
node: the sort and the ragged per-expert matmuls have no static-shape ATen form (the
alternatives, every expert on every token or a copy of each token's chosen weights,
are kiln.models.moe's "dense" and "gathered" forms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import DTypeError, ShapeError

_WHERE = "kiln.ops.moe_experts"
_LAYOUT = ("x [N, dim]; weights [N, k] float32 and ids [N, k] int32/int64; gate and up "
           "[E, I, dim]; down [E, dim, I]")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """y [N, dim] in x's dtype: each token's chosen experts' SwiGLU outputs, weighted."""
    check_operands(x, weights, ids, gate, up, down)
    return torch.ops.kiln.moe_experts(x, weights, ids, gate, up, down)


def routing_bound(tokens, top_k: int):
    """The sorted row buffer's size, N * k (an int, or symbolic with N): it bounds every
    data-dependent size of the op, since an expert has at most all the pairs."""
    return tokens * top_k


def check_operands(x, weights, ids, gate, up, down, weight_dtype=None,
                   where: str = _WHERE) -> None:
    """Shapes and dtypes a caller can get wrong, said in the op's own terms. The experts'
    weights have x's dtype, or `weight_dtype` (the fp8 form's e4m3)."""
    for name, t, rank in (("x", x, 2), ("weights", weights, 2), ("ids", ids, 2),
                          ("gate", gate, 3), ("up", up, 3), ("down", down, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"{name} must be a {rank}-d tensor, got {got}", where=where,
                             hint=_LAYOUT)
    N, dim = x.shape
    E, inter, _ = gate.shape
    if tuple(weights.shape) != tuple(ids.shape) or ids.shape[0] != N:
        raise ShapeError(f"weights {list(weights.shape)} and ids {list(ids.shape)} must both "
                         f"be [N, k] with N = {N} tokens (x {list(x.shape)})", where=where,
                         hint=_LAYOUT)
    want = {"gate": (E, inter, dim), "up": (E, inter, dim), "down": (E, dim, inter)}
    for name, t in (("gate", gate), ("up", up), ("down", down)):
        if tuple(t.shape) != want[name]:
            raise ShapeError(f"{name} has shape {list(t.shape)}; with x {list(x.shape)} and "
                             f"gate {list(gate.shape)} it must be {list(want[name])}",
                             where=where, hint=_LAYOUT)
    if x.dtype not in _FLOATS:
        raise DTypeError(f"x has dtype {x.dtype}; it must be float16, bfloat16 or float32",
                         where=where)
    for name, t in (("gate", gate), ("up", up), ("down", down)):
        if weight_dtype is not None and t.dtype != weight_dtype:
            raise DTypeError(f"{name} has dtype {t.dtype}; it must be {weight_dtype}",
                             where=where, hint="kiln.ops.quantize_experts(w) makes the fp8 "
                             "experts and their block scales from real ones")
        if weight_dtype is None and t.dtype != x.dtype:
            raise DTypeError(f"{name} has dtype {t.dtype}, x has {x.dtype}: the experts' "
                             "weights must have x's dtype", where=where,
                             hint="cast x or the weights so they agree")
    if weights.dtype != torch.float32:
        raise DTypeError(f"weights has dtype {weights.dtype}; it must be float32",
                         where=where, hint="the router's weights: pass weights.float()")
    if ids.dtype not in _INTS:
        raise DTypeError(f"ids has dtype {ids.dtype}; it must be int32 or int64",
                         where=where)
    _check_ids(ids, E, where)


def _check_ids(ids: torch.Tensor, experts: int, where: str = _WHERE) -> None:
    """Expert ids in [0, E), when the values can be seen (not while exporting, nor
    inside a CUDA graph capture, where reading them back is not allowed)."""
    if ids.numel() == 0 or ids.device.type == "meta" or _is_traced(ids):
        return
    if ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= experts:
        bad = lo if lo < 0 else hi
        raise ShapeError(f"ids holds expert {bad}, outside [0, {experts}) for {experts} "
                         "experts", where=where,
                         hint="ids are indices into the stacked experts' first dim")


def _is_traced(t: torch.Tensor) -> bool:
    """A fake or functional tensor of an export: its values do not exist yet."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(t, FakeTensor | FunctionalTensor) or torch.compiler.is_compiling()


def sorted_by_expert(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, list[int]]:
    """(the pairs n * k + j sorted by expert, stable [N * k]; each expert's row count).
    Pairs of an id outside [0, E) sort last and belong to no expert."""
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < experts)
    order = torch.argsort(torch.where(valid, flat, experts), stable=True)
    counts = torch.bincount(flat[valid], minlength=experts)
    return order, counts.tolist()


# ---- the op ---------------------------------------------------------------------------


@torch.library.custom_op("kiln::moe_experts", mutates_args=())
def _moe_experts_op(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    N, dim = x.shape
    k = ids.shape[1]
    order, counts = sorted_by_expert(ids, gate.shape[0])
    flat_weights = weights.reshape(-1)
    parts = x.new_zeros((N * k, dim))  # each pair's weighted output, at the pair's row
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        xe = x[pairs // k]
        h = F.silu(xe @ gate[e].t()) * (xe @ up[e].t())
        out = (h @ down[e].t()).float() * flat_weights[pairs, None]
        parts[pairs] = out.to(x.dtype)
    # every token's k rows in the order of j, in fp32: no dependence on the expert order
    return parts.view(N, k, dim).float().sum(1).to(x.dtype)


@_moe_experts_op.register_fake
def _(x, weights, ids, gate, up, down):
    return x.new_empty(x.shape)
