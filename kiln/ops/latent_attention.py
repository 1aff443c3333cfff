"""Multi-head latent attention over a latent cache (DeepSeek-V3's absorbed decode), as
one op kiln keeps whole.

Every head attends to the same cached rows: a row is a compressed latent c [R] and a
rotary key k_rope [P] (R = 512, P = 64 in V3). With W_UK folded into the query,

    score(h, t, s) = scale * (q_latent[h, t] . c_s + q_rope[h, t] . k_rope_s)
    out[h, t] = sum_s softmax_s(score) c_s           [R: the latent space, before W_UV]

so the cache row is the key (R + P wide) and its c part the value, for all heads.
Causal by position: the query at input_pos[b, t] sees the sequence's keys 0..input_pos.

The cache is given in one of the model's two layouts (kiln.models.kv_cache):
- contiguous: kv_latent [rows, S, R], k_rope [rows, S, P]; batch row b is cache row b
  (rows >= B), its key s at [b, s];
- paged: kv_latent [blocks, block_size, R], k_rope [blocks, block_size, P] and
  block_table [B, W]: key s of batch row b is at [block_table[b, s // block_size],
  s % block_size].

It is a torch.library custom op (`kiln::latent_attention`) so that torch.export keeps it
as one node and a GPU target generates one kernel that reads each cache row once for
a block of heads (kiln.codegen.templates.latent_attention): ATen's form gathers and
concatenates the cache, then broadcasts it to every head. The PyTorch implementation
below defines it (and is what the CPU target runs): the scaled dot product attention
the model computed before the op existed, with the same positions mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.errors import DTypeError, ShapeError

_WHERE = "kiln.ops.latent_attention"
_LAYOUT = ("q_latent [B, S_q, H, R], q_rope [B, S_q, H, P]; kv_latent [rows, S, R] and "
           "k_rope [rows, S, P] (contiguous) or [blocks, block_size, R / P] with "
           "block_table [B, W] (paged); input_pos [B, S_q]")


def latent_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_latent: torch.Tensor,
                     k_rope: torch.Tensor, input_pos: torch.Tensor, scale: float,
                     block_table: torch.Tensor | None = None) -> torch.Tensor:
    """The latent-space attention output [B, S_q, H, R] in q_latent's dtype.

    scale multiplies the scores (the caller includes YaRN's mscale). input_pos [B, S_q]
    holds each query's position; block_table (paged cache) maps each row's positions
    to cache blocks, as the module docstring says.
    """
    _check(q_latent, q_rope, kv_latent, k_rope, input_pos, block_table)
    return torch.ops.kiln.latent_attention(q_latent, q_rope, kv_latent, k_rope, input_pos,
                                           float(scale), block_table)


def _check(q_latent, q_rope, kv_latent, k_rope, input_pos, block_table) -> None:
    """Shapes and dtypes a caller can get wrong, said in the op's own terms."""
    for name, t, rank in (("q_latent", q_latent, 4), ("q_rope", q_rope, 4),
                          ("kv_latent", kv_latent, 3), ("k_rope", k_rope, 3),
                          ("input_pos", input_pos, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != rank:
            got = f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ShapeError(f"{name} must be a {rank}-d tensor, got {got}", where=_WHERE,
                             hint=_LAYOUT)
    B, Sq, H, R = q_latent.shape
    P = q_rope.shape[-1]
    if tuple(q_rope.shape[:3]) != (B, Sq, H):
        raise ShapeError(f"q_rope has shape {list(q_rope.shape)}; its batch, length and "
                         f"heads must be q_latent's {[B, Sq, H]}", where=_WHERE, hint=_LAYOUT)
    if kv_latent.shape[-1] != R or k_rope.shape[-1] != P:
        raise ShapeError(f"the cache's widths {kv_latent.shape[-1]} + {k_rope.shape[-1]} "
                         f"differ from the query's {R} + {P}", where=_WHERE,
                         hint="q_latent is the query times W_UK, as wide as the latent")
    if tuple(kv_latent.shape[:2]) != tuple(k_rope.shape[:2]):
        raise ShapeError(f"kv_latent {list(kv_latent.shape)} and k_rope "
                         f"{list(k_rope.shape)} are not the same cache rows", where=_WHERE,
                         hint="both are parts of one cache, in the same layout")
    if tuple(input_pos.shape) != (B, Sq):
        raise ShapeError(f"input_pos has shape {list(input_pos.shape)}, expected {[B, Sq]}",
                         where=_WHERE, hint="one position per query")
    if input_pos.dtype not in (torch.int32, torch.int64):
        raise DTypeError(f"input_pos has dtype {input_pos.dtype}; it must be int32 or int64",
                         where=_WHERE)
    if block_table is None:
        if kv_latent.shape[0] < B:
            raise ShapeError(f"the contiguous cache has {kv_latent.shape[0]} rows for a "
                             f"batch of {B}", where=_WHERE,
                             hint="batch row b reads cache row b")
    else:
        if block_table.dim() != 2 or block_table.shape[0] != B:
            raise ShapeError(f"block_table has shape {list(block_table.shape)}, expected "
                             f"[{B}, blocks per row]", where=_WHERE, hint=_LAYOUT)
        if block_table.dtype not in (torch.int32, torch.int64):
            raise DTypeError(f"block_table has dtype {block_table.dtype}; it must be int32 "
                             "or int64", where=_WHERE)
    dtypes = {t.dtype for t in (q_latent, q_rope, kv_latent, k_rope)}
    if len(dtypes) != 1 or not q_latent.dtype.is_floating_point:
        raise DTypeError(f"q_latent, q_rope, kv_latent and k_rope have dtypes "
                         f"{q_latent.dtype}, {q_rope.dtype}, {kv_latent.dtype}, "
                         f"{k_rope.dtype}: they must be one floating-point dtype",
                         where=_WHERE, hint="cast the query to the cache's dtype")


def sequence_cache(kv_latent: torch.Tensor, k_rope: torch.Tensor, batch: int,
                   block_table: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each batch row's keys in order: ([B, S, R], [B, S, P])."""
    if block_table is None:
        return kv_latent[:batch], k_rope[:batch]
    return kv_latent[block_table].flatten(1, 2), k_rope[block_table].flatten(1, 2)


# ---- the op ---------------------------------------------------------------------------


@torch.library.custom_op("kiln::latent_attention", mutates_args=())
def _latent_attention_op(q_latent: torch.Tensor, q_rope: torch.Tensor,
                         kv_latent: torch.Tensor, k_rope: torch.Tensor,
                         input_pos: torch.Tensor, scale: float,
                         block_table: torch.Tensor | None) -> torch.Tensor:
    B, Sq, H, R = q_latent.shape
    kv, kr = sequence_cache(kv_latent, k_rope, B, block_table)
    S = kv.shape[1]
    keys = torch.arange(S, device=kv.device)
    mask = keys[None, None, None, :] <= input_pos[:, None, :, None]  # [B, 1, S_q, S]
    q = torch.cat((q_latent, q_rope), dim=-1).transpose(1, 2)  # [B, H, S_q, R + P]
    k = torch.cat((kv, kr), dim=-1)[:, None]  # one key head shared by every query head
    y = F.scaled_dot_product_attention(q, k, kv[:, None], attn_mask=mask, scale=scale,
                                       enable_gqa=True)  # [B, H, S_q, R]
    return y.transpose(1, 2).contiguous()


@_latent_attention_op.register_fake
def _(q_latent, q_rope, kv_latent, k_rope, input_pos, scale, block_table):
    return torch.empty_like(q_latent, memory_format=torch.contiguous_format)
