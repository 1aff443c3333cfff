"""Fixtures: tiny HF checkpoints, and kiln LLMs compiled from them.

Compiling is the slow part, so the LLMs are session fixtures shared by the test files;
every test starts its sequences at position 0, so the shared KV caches need no reset.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny shapes gain nothing from intra-op threads; on a shared CI box they stall."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def paged_llm(checkpoints):
    """The llama3.1 checkpoint with a paged cache of 4-token blocks."""
    import kiln.models

    return kiln.models.load(checkpoints["llama3.1"][0], max_batch_size=3, paged=True,
                            block_size=4, dtype=torch.float32)
