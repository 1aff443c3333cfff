"""Paged and contiguous KV caches: same logits; batched decode equals decoding alone."""

import pytest
import torch

from kiln.errors import ArgumentError, ResourceError, ShapeError
from kiln.models.kv_cache import BlockAllocator
from tests.helpers import rel_err
from tests.models.support import run_alone, run_batched

PROMPT_LENS = (3, 9, 14)
STEPS = 5


@pytest.fixture(scope="module")
def script(llms):
    vocab = llms("llama3.1").cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=gen) for n in PROMPT_LENS]
    steps = torch.randint(3, vocab, (len(prompts), STEPS), generator=gen)
    return prompts, steps


def test_paged_and_contiguous_caches_give_the_same_logits(llms, paged_llm, script):
    prompts, steps = script
    contiguous = run_alone(llms("llama3.1"), prompts[2], steps[2])
    paged = run_alone(paged_llm, prompts[2], steps[2])
    assert rel_err(paged, contiguous) <= 1e-6


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_batched_decode_gives_each_sequence_what_it_gets_alone(cache, llms, paged_llm, script):
    llm = paged_llm if cache == "paged" else llms("llama3.1")
    prompts, steps = script
    batched = run_batched(llm, prompts, steps)
    for i, p in enumerate(prompts):
        alone = run_alone(llm, p, steps[i])
        assert rel_err(batched[i], alone) <= 1e-5, (cache, i, rel_err(batched[i], alone))


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_batched_generation_with_early_stops_matches_alone(cache, llms, paged_llm, script):
    """Rows finish at different steps (a stop token); the others carry on unchanged."""
    llm = paged_llm if cache == "paged" else llms("llama3.1")
    prompts = [p.tolist() for p in script[0]]
    first = llm.generate(prompts[0], max_new_tokens=12, ignore_eos=True)
    stop = [first.ids[4]]  # sequence 0 stops after at most 5 tokens
    alone = [llm.generate(p, max_new_tokens=12, ignore_eos=True, stop=stop) for p in prompts]
    batched = llm.generate(prompts, max_new_tokens=12, ignore_eos=True, stop=stop)
    assert len(alone[0].ids) <= 5 and alone[0].finish_reason == "stop"
    longest = max(alone, key=lambda a: len(a.ids))  # the row that runs to the end
    assert longest.finish_reason == "length" and len(set(longest.ids)) >= 8, longest.ids
    assert [b.ids for b in batched] == [a.ids for a in alone]
    assert [b.finish_reason for b in batched] == [a.finish_reason for a in alone]


def test_paged_decode_reads_only_the_blocks_in_the_table(paged_llm):
    """A narrow block table compiles to attention over fewer keys, not max_seq_len."""
    cache = paged_llm.model.cache
    alloc = BlockAllocator(cache)
    alloc.reserve(0, 6)
    assert alloc.block_table([0]).shape == (1, 2)
    logits = paged_llm.forward(torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.arange(6),
                               alloc.block_table([0]))
    assert logits.shape == (1, 6, paged_llm.cfg.vocab_size)


def test_block_allocator_free_list(paged_llm):
    cache = paged_llm.model.cache
    alloc = BlockAllocator(cache)
    usable = cache.num_blocks - 1  # block 0 is never handed out
    alloc.reserve(0, 5)  # two blocks of 4
    alloc.reserve(1, 1)
    assert alloc.owned == {0: [1, 2], 1: [3]}
    table = alloc.block_table([1, 0])
    assert table.tolist() == [[3, 0], [1, 2]]  # padded with block 0
    alloc.release(0)
    alloc.reserve(2, 8)
    assert sorted(alloc.owned[2]) == [1, 2]  # freed blocks are reused
    assert len(alloc.free) == usable - 3
    with pytest.raises(ShapeError, match="maximum context of 128"):
        alloc.reserve(3, cache.blocks_per_seq * cache.block_size + 1)
    for s in range(10, 10 + len(alloc.free) // cache.blocks_per_seq):
        alloc.reserve(s, cache.blocks_per_seq * cache.block_size)
    with pytest.raises(ResourceError, match="paged KV cache is full"):
        alloc.reserve(99, cache.blocks_per_seq * cache.block_size)


def test_prefill_logits_at_given_positions_match_the_full_logits(llms, paged_llm):
    """Generation asks the prefill for each prompt's last position only; any positions
    (several per row, different per row) give what the full logits hold there."""
    gen = torch.Generator().manual_seed(3)
    for llm in (llms("llama3.1"), paged_llm):
        tokens = torch.randint(0, llm.cfg.vocab_size, (2, 7), generator=gen)
        table = None
        if llm.paged:
            alloc = BlockAllocator(llm.model.cache)
            for row in (0, 1):
                alloc.reserve(row, 7)
            table = alloc.block_table([0, 1])
        full = llm.forward(tokens, torch.arange(7), table)
        at = torch.tensor([[6, 2, 0], [3, 3, 5]])
        some = llm.forward(tokens, torch.arange(7), table, logits_at=at)
        assert some.shape == (2, 3, llm.cfg.vocab_size)
        want = full.gather(1, at[:, :, None].expand(-1, -1, full.shape[-1]))
        assert rel_err(some, want) < 1e-6
        if table is not None:
            alloc.release(0)
            alloc.release(1)


def test_logits_at_on_a_decode_step_is_an_argument_error(llms):
    llm = llms("llama3.1")
    with pytest.raises(ArgumentError, match="logits_at is for prefill"):
        llm.forward(torch.tensor([[1]]), torch.tensor([0]), logits_at=torch.tensor([[0]]))
