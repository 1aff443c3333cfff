"""A Llama-2-70B-shaped model on the meta device, for reading multi-device plans on a
machine without the GPUs (or the memory) to run them: dim 8192, 80 layers, 64 heads
over 8 KV heads, FFN 28672, vocab 32000, fp16, a paged KV cache, a 2048-token prompt.

    kiln explain benchmarks/llama2_70b_plan.py:model --target cuda:sm_90 -tp 8 --tune none
    kiln explain benchmarks/llama2_70b_plan.py:model --target cuda:sm_90 -tp 8 --rank 3

plans every rank compile-only and prints each one's weight bytes, collectives and
transfers (--rank R: that rank's regions too); `model_2_layers` is the same with 2 layers.
"""

from __future__ import annotations

import torch

from kiln.models.llama import PRESETS, Llama


def model(layers: int = 80, prompt: int = 2048):
    """(model, args) of a prefill of `prompt` tokens through a paged cache (meta)."""
    cfg = PRESETS["llama2-70b"].with_(n_layers=layers, max_seq_len=prompt)
    with torch.device("meta"):  # shapes only: no weight is ever allocated
        m = Llama(cfg).to(torch.float16)
        m.setup_cache(dtype=torch.float16, paged=True, block_size=16)
    blocks = prompt // 16
    args = (torch.zeros(1, prompt, dtype=torch.long, device="meta"),
            torch.arange(prompt, device="meta"),
            torch.zeros(1, blocks, dtype=torch.long, device="meta"))
    return m, args


def model_2_layers():
    return model(layers=2)
