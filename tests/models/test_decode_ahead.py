"""The decode loop one step ahead (kiln.models.decode_ahead): each step is launched from
the previous step's device tokens before the host reads them; what the host learns late
(a stop token) costs at most the step in flight, which is never waited for."""

import types

import pytest
import torch

import kiln.models
from kiln.models import decode_ahead
from kiln.models.generate import _Seq


class Picks:
    """A step's tokens as the device holds them: reading them is logged."""

    def __init__(self, log, step, tokens):
        self.log, self.step, self.tokens = log, step, tokens

    def tolist(self):
        self.log.append(("read", self.step))
        return list(self.tokens)


def _fake_llm(log, script):
    """An LLM whose decode step `t` picks script[t] for each row."""
    llm = types.SimpleNamespace(max_seq_len=100, paged=False, device=torch.device("cpu"))
    steps = []

    def step(batch, alloc, tokens, pos):
        steps.append((tokens, pos))
        log.append(("launch", len(steps)))
        return len(steps)

    llm._decode_step = step
    return llm, steps, lambda t: Picks(log, t, script[t - 1])


def _add(stop):
    def add(seq, token, now):
        seq.ids.append(token)
        if token == stop:
            seq.finish = "stop"
        elif len(seq.ids) >= 6:
            seq.finish = "length"
    return add


def test_each_step_is_launched_before_the_previous_one_is_read():
    log = []
    script = [[7, 7], [8, 8], [9, 9], [10, 10], [11, 11]]
    llm, steps, pick = _fake_llm(log, script)
    seqs = [_Seq(0, [1, 2], None, [5]), _Seq(1, [3], None, [6])]
    decode_ahead.decode(llm, seqs, None, pick, _add(stop=None), max_new_tokens=6)
    assert log == [("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2),
                   ("launch", 4), ("read", 3), ("launch", 5), ("read", 4), ("read", 5)]
    assert [s.ids for s in seqs] == [[5, 7, 8, 9, 10, 11], [6, 7, 8, 9, 10, 11]]
    # step 2 onwards took the previous step's device tokens as they were
    assert [t.step for t, _ in steps[1:]] == [1, 2, 3, 4]
    assert steps[0][0].tolist() == [5, 6]  # the first step: the host's tokens
    # positions run ahead of what the host has read; no step past max_new_tokens
    assert [p for _, p in steps] == [[2, 1], [3, 2], [4, 3], [5, 4], [6, 5]]


def test_a_stop_found_late_drops_the_step_in_flight_without_waiting_for_it():
    log = []
    script = [[7, 7], [0, 8], [9, 9], [10, 10]]
    llm, steps, pick = _fake_llm(log, script)
    seqs = [_Seq(0, [1], None, [5])]
    decode_ahead.decode(llm, seqs, None, pick, _add(stop=0), max_new_tokens=50)
    # step 3 was launched before step 2's stop was read, and is never read
    assert log == [("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2)]
    assert seqs[0].ids == [5, 7, 0] and seqs[0].finish == "stop"


def test_paged_rows_that_stopped_leave_the_next_step():
    """A real LLM on the CPU, paged: one prompt of a batch stops at a token it
    generates midway; the batch's tokens equal each prompt generated alone."""
    llm = kiln.models.load("tiny", target="cpu", max_seq_len=64, max_batch_size=4,
                           paged=True, block_size=8, random_weights=True)
    prompts = [[1, 5, 9, 13], [2, 4, 6], [7, 3, 11, 2, 8]]
    alone = [llm.generate(p, max_new_tokens=12, ignore_eos=True).ids for p in prompts]
    stop = alone[1][4]  # the second prompt stops at its fifth new token
    want = [a[:a.index(stop) + 1] if stop in a else a for a in alone]
    got = llm.generate(prompts, max_new_tokens=12, ignore_eos=True, stop=[stop])
    assert [g.ids for g in got] == want
    assert got[1].finish_reason == "stop"


def test_host_copy_on_the_cpu_reads_the_tensor():
    assert decode_ahead.HostCopy(torch.tensor([3, 4])).tolist() == [3, 4]


@pytest.mark.gpu
def test_reading_a_step_does_not_wait_for_the_step_launched_after_it():
    """The picks' copy is queued right behind the pick: reading them returns while a
    long kernel queued later still runs (a plain tolist() would wait for it)."""
    picks = torch.tensor([5, 6], device="cuda")
    copy = decode_ahead.HostCopy(picks)
    later = torch.cuda.Event()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles: the next step
    later.record()
    assert copy.tolist() == [5, 6]
    assert not later.query()
    torch.cuda.synchronize()
