"""Attention whose scores are soft-capped before the mask: softmax(cap * tanh(q @ k^T *
scale / cap) + mask) @ v (Gemma 2's `attn_logit_softcapping`, Grok's 30).

SDPA has no cap, so transformers runs Gemma 2 through its eager attention: two batched
products and a softmax, the [T, S] scores stored and read back at every layer (at
decode three dependent kernels, ~10 us a layer for 0.5 us of bytes on an H200).
graph/eager_attention.py rewrites that chain to this op, which graph/patterns.py labels
"attention" as it does SDPA, and kiln's attention kernel computes the cap on its scores
in registers. The op's arguments are SDPA's (same names, a mask that selects when bool
and adds otherwise, GQA, is_causal, which graph/causal_sdpa.py sets for a mask its
aranges prove causal) plus `softcap`; its PyTorch form below defines it (in fp32, as
the kernel keeps its scores) and runs it where no kernel is generated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("kiln::softcap_attention", mutates_args=())
def softcap_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None, scale: float, softcap: float,
                      enable_gqa: bool = False, is_causal: bool = False) -> torch.Tensor:
    q, k, v = query.float(), key.float(), value.float()
    if enable_gqa and q.dim() == 4 and k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = softcap * torch.tanh(q @ k.transpose(-2, -1) * (scale / softcap))
    if attn_mask is not None:
        s = (s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
             else s + attn_mask.float())
    if is_causal:  # SDPA's: key j kept for query i when j <= i (top-left aligned)
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return (F.softmax(s, dim=-1) @ v).to(query.dtype)


@softcap_attention.register_fake
def _(query, key, value, attn_mask, scale, softcap, enable_gqa=False, is_causal=False):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
