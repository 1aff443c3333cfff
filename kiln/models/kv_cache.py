"""KV caches: module state written in place by the compiled model, and the block allocator.

Both caches keep keys and values as [..., n_kv_heads, head_dim] rows, and both give
attention the sequence's whole cache as [B, S, n_kv_heads, head_dim] plus the
position of each of the S entries; attention masks what lies after the query.

- ContiguousKVCache (gpt-fast's): [max_batch, max_seq_len, KV, D]; row b of a call's
  batch is cache row b, so a batch's sequences keep their rows for the whole batch.
- PagedKVCache: a pool of fixed-size blocks shared by all sequences,
  [num_blocks * block_size, KV, D]. Position p of the sequence in batch row b lives in
  slot block_table[b, p // block_size] * block_size + p % block_size. The table's
  width (blocks per row) is the caller's choice: attention reads width * block_size
  entries, so a batch of short sequences reads little. Block 0 is never handed out:
  unused table entries (and padding rows) point at it, and what they write there is
  never read unmasked.
- BlockAllocator: the host side of the paged cache, a free list of blocks and each
  sequence's blocks in order. It needs only the cache's PagedLayout (a saved LLM has
  no cache module, only its compiled modules' buffers).
- ContiguousLatentCache / PagedLatentCache: the same two layouts for multi-head latent
  attention (DeepSeek-V3), which caches one row per token shared by every head (the
  compressed kv latent and the rotary key) instead of keys and values per head.
- LinearAttentionState: what a linear-attention layer (Qwen3-Next's gated delta rule)
  keeps instead of keys and values: per cache row, the recurrent state [HV, K, V] in
  fp32 and the last kernel - 1 inputs of its causal convolution. Its size does not
  grow with the sequence; a row is reset by any call whose first position is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from kiln.errors import ResourceError, ShapeError


class ContiguousKVCache(nn.Module):
    def __init__(self, cfg, max_batch_size: int, dtype: torch.dtype):
        super().__init__()
        self.max_batch_size, self.max_seq_len = max_batch_size, cfg.max_seq_len
        shape = (max_batch_size, cfg.max_seq_len, cfg.n_kv_heads, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def positions(self, block_table, device) -> torch.Tensor:
        return torch.arange(self.max_seq_len, device=device)[None]

    def update(self, input_pos, k, v, block_table=None):
        """Write k, v [B, T, KV, D] at input_pos [B, T]; return rows 0..B-1 of the cache."""
        B = k.shape[0]
        rows = torch.arange(B, device=k.device)[:, None]
        self.k_cache[rows, input_pos] = k
        self.v_cache[rows, input_pos] = v
        return self.k_cache[:B], self.v_cache[:B]


class PagedKVCache(nn.Module):
    def __init__(self, cfg, max_batch_size: int, block_size: int, num_blocks: int | None,
                 dtype: torch.dtype):
        super().__init__()
        self.block_size = block_size
        self.blocks_per_seq = math.ceil(cfg.max_seq_len / block_size)
        self.num_blocks = num_blocks or max_batch_size * self.blocks_per_seq + 1
        shape = (self.num_blocks * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)

    def positions(self, block_table, device) -> torch.Tensor:
        return torch.arange(block_table.shape[1] * self.block_size, device=device)[None]

    def update(self, input_pos, k, v, block_table):
        """Write k, v [B, T, KV, D] at input_pos [B, T] through block_table [B, W];
        return each row's W blocks as [B, W * block_size, KV, D]."""
        bs = self.block_size
        slots = block_table.gather(1, input_pos // bs) * bs + input_pos % bs
        self.k_cache[slots] = k
        self.v_cache[slots] = v
        blocks = (self.num_blocks, bs, *k.shape[2:])
        k_all = self.k_cache.view(blocks)[block_table].flatten(1, 2)
        v_all = self.v_cache.view(blocks)[block_table].flatten(1, 2)
        return k_all, v_all


@dataclass(frozen=True)
class PagedLayout:
    """A paged cache's geometry: all that its host side (block tables) needs."""

    block_size: int
    blocks_per_seq: int
    num_blocks: int


class BlockAllocator:
    """Which blocks of a paged cache each sequence owns; the rest are on the free list."""

    def __init__(self, cache: PagedKVCache | PagedLatentCache | PagedLayout):
        self.block_size = cache.block_size
        self.blocks_per_seq = cache.blocks_per_seq
        self.num_blocks = cache.num_blocks
        self.free = list(range(cache.num_blocks - 1, 0, -1))  # pop() hands out 1, 2, ...
        self.owned: dict[int, list[int]] = {}

    def reserve(self, seq: int, n_positions: int) -> None:
        """Make sure sequence `seq` owns blocks for positions 0..n_positions-1."""
        need = math.ceil(n_positions / self.block_size)
        if need > self.blocks_per_seq:
            raise ShapeError(
                f"sequence {seq} needs {n_positions} positions, more than the maximum context "
                f"of {self.blocks_per_seq * self.block_size}",
                hint="shorten the prompt or max_new_tokens, or load with a larger max_seq_len")
        blocks = self.owned.setdefault(seq, [])
        if need - len(blocks) > len(self.free):
            raise ResourceError(
                f"the paged KV cache is full: sequence {seq} needs {need - len(blocks)} more "
                f"blocks of {self.block_size} tokens, {len(self.free)} of "
                f"{self.num_blocks - 1} are free",
                hint="generate fewer sequences at once, or give the cache more blocks "
                "(num_blocks)")
        while len(blocks) < need:
            blocks.append(self.free.pop())

    def release(self, seq: int) -> None:
        self.free.extend(reversed(self.owned.pop(seq, [])))

    def block_table(self, seqs: list[int], width: int | None = None,
                    device=None) -> torch.Tensor:
        """[len(seqs), width] int64: each sequence's blocks, padded with block 0."""
        width = width or max((len(self.owned.get(s, [])) for s in seqs), default=1) or 1
        table = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            blocks = self.owned.get(s, [])[:width]
            table[row, :len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        return table.to(device) if device is not None else table


class ContiguousLatentCache(nn.Module):
    """Multi-head latent attention's cache: one row of `width` numbers per token, shared
    by every head (DeepSeek-V3: the compressed kv latent and the rotary key).
    [max_batch, max_seq_len, width]; rows as ContiguousKVCache's."""

    def __init__(self, max_seq_len: int, width: int, max_batch_size: int, dtype: torch.dtype):
        super().__init__()
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.register_buffer("latent_cache",
                             torch.zeros(max_batch_size, max_seq_len, width, dtype=dtype),
                             persistent=False)

    def positions(self, block_table, device) -> torch.Tensor:
        return torch.arange(self.max_seq_len, device=device)[None]

    def write(self, input_pos, latent, block_table=None):
        """Write latent [B, T, width] at input_pos [B, T]."""
        rows = torch.arange(latent.shape[0], device=latent.device)[:, None]
        self.latent_cache[rows, input_pos] = latent

    def update(self, input_pos, latent, block_table=None):
        """Write latent [B, T, width] at input_pos [B, T]; return rows 0..B-1 [B, S, width]."""
        self.write(input_pos, latent)
        return self.latent_cache[:latent.shape[0]]

    def rows(self) -> torch.Tensor:
        """The whole cache in kiln.ops.latent_attention's contiguous layout [rows, S, width]."""
        return self.latent_cache


class PagedLatentCache(nn.Module):
    """The latent cache in blocks, addressed as PagedKVCache's (BlockAllocator serves both):
    [num_blocks * block_size, width]."""

    def __init__(self, max_seq_len: int, width: int, max_batch_size: int, block_size: int,
                 num_blocks: int | None, dtype: torch.dtype):
        super().__init__()
        self.block_size = block_size
        self.blocks_per_seq = math.ceil(max_seq_len / block_size)
        self.num_blocks = num_blocks or max_batch_size * self.blocks_per_seq + 1
        self.register_buffer("latent_cache",
                             torch.zeros(self.num_blocks * block_size, width, dtype=dtype),
                             persistent=False)

    def positions(self, block_table, device) -> torch.Tensor:
        return torch.arange(block_table.shape[1] * self.block_size, device=device)[None]

    def write(self, input_pos, latent, block_table):
        """Write latent [B, T, width] at input_pos [B, T] through block_table [B, W]."""
        bs = self.block_size
        slots = block_table.gather(1, input_pos // bs) * bs + input_pos % bs
        self.latent_cache[slots] = latent

    def update(self, input_pos, latent, block_table):
        """Write as `write`; return each row's W blocks as [B, W * block_size, width]."""
        self.write(input_pos, latent, block_table)
        return self.rows()[block_table].flatten(1, 2)

    def rows(self) -> torch.Tensor:
        """The pool in kiln.ops.latent_attention's paged layout [blocks, block_size, width]."""
        return self.latent_cache.view(self.num_blocks, self.block_size, -1)


class LinearAttentionState(nn.Module):
    """Per-row recurrent and convolution state of one linear-attention layer.

    Like the contiguous KV cache, row b of a call's batch is cache row b. A call reads
    the state its rows left (zeros for a row starting at position 0) and writes the
    state after its tokens.
    """

    def __init__(self, max_batch_size: int, conv_channels: int, conv_kernel: int,
                 state_shape: tuple[int, int, int], dtype: torch.dtype):
        super().__init__()
        self.max_batch_size = max_batch_size
        self.register_buffer(
            "conv", torch.zeros(max_batch_size, conv_kernel - 1, conv_channels, dtype=dtype),
            persistent=False)
        self.register_buffer(
            "recurrent", torch.zeros(max_batch_size, *state_shape, dtype=torch.float32),
            persistent=False)

    def read(self, input_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv [B, kernel - 1, C], recurrent [B, HV, K, V]) for rows 0..B-1."""
        B = input_pos.shape[0]
        fresh = (input_pos[:, 0] == 0)[:, None, None]
        conv = torch.where(fresh, 0, self.conv[:B])
        recurrent = torch.where(fresh[..., None], 0, self.recurrent[:B])
        return conv, recurrent

    def write(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        rows = torch.arange(conv.shape[0], device=conv.device)
        self.conv[rows] = conv.to(self.conv.dtype)
        self.recurrent[rows] = recurrent
