"""kiln.models.load's arguments, checked before a checkpoint is read or a model built.

A max_seq_len of -5 or a dtype of 5 used to fail seconds later inside torch (arange,
Module.to) as a raw RuntimeError; each is named here instead.
"""

from __future__ import annotations

import numbers
import os

from kiln.errors import ArgumentError
from kiln.models.generate import check_cache_sizes
from kiln.models.hf import DTYPES


def check_load_args(source, dtype, max_seq_len, max_batch_size, block_size, num_blocks,
                    seed, tensor_parallel_size, pipeline_parallel_size) -> None:
    if not isinstance(source, (str, os.PathLike)) or not str(source):
        raise ArgumentError(f"name a checkpoint directory or a preset, got "
                            f"{type(source).__name__} {source!r}",
                            hint="e.g. kiln.models.load('path/to/Llama-3-8B') or "
                            "kiln.models.load('tiny')")
    if dtype is not None and not isinstance(dtype, str) and dtype not in DTYPES.values():
        raise ArgumentError(f"dtype {dtype!r} is not one kiln's models run in",
                            hint=f"one of {', '.join(DTYPES)} (a string or torch dtype)")
    if max_seq_len is not None and not _positive_int(max_seq_len):
        raise ArgumentError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
    check_cache_sizes(max_batch_size, block_size, num_blocks)
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ArgumentError(f"seed must be an int, got {seed!r}")
    for name, v in (("tensor_parallel_size", tensor_parallel_size),
                    ("pipeline_parallel_size", pipeline_parallel_size)):
        if not _positive_int(v):
            raise ArgumentError(f"{name} must be a positive int, got {v!r}",
                                hint="1 runs on one device")


def _positive_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1

