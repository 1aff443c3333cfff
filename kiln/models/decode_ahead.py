"""The decode loop one step ahead of the host: step t + 1 is launched from step t's
tokens as the device picked them, before the host reads them.

A step that waits for its tokens on the host (to append them, check stops, stream
text) and only then builds and launches the next leaves the GPU idle for all of that
host work: 0.6 ms a token on an H100 against a 7.0 ms graph replay for Llama-3-8B
(benchmarks/generate.py). Here the next step's inputs are device tensors (the picked
tokens; positions and block tables copied without blocking), so the host's reading
of step t overlaps step t + 1 on the GPU.

What the host cannot know before it reads step t is whether a token was a stop: a
sequence that stopped there is still in step t + 1, whose token for it is dropped
(its cache rows past the end are never read), and when every sequence has stopped,
the step in flight is left to finish on its own. Lengths and the context limit are
known ahead, so they cost no extra step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class _Step:
    batch: list  # the _Seqs it decodes, in row order
    picks: torch.Tensor  # [len(batch)] the tokens it picked, on the device
    copy: HostCopy  # the picks on their way to the host, started right after the pick


def decode(llm, seqs: list, alloc, pick, add, max_new_tokens: int) -> None:
    """Decode `seqs` (each with its first token) until every one finishes.

    pick(logits [n, vocab]) -> [n] token ids on the logits' device;
    add(seq, token, now) appends a token and sets seq.finish."""
    inflight: _Step | None = None
    while True:
        batch = _next_batch(llm, seqs, inflight, max_new_tokens)
        launched = None
        if batch:
            tokens, pos = _inputs(llm, batch, inflight)
            logits = llm._decode_step(batch, alloc, tokens, pos)
            picks = pick(logits)
            launched = _Step(batch, picks, HostCopy(picks))
        if inflight is not None:
            _read(inflight, add)
        if launched is not None and all(s.finish is not None for s in launched.batch):
            return  # every row of the step in flight stopped: leave it to finish
        inflight = launched
        if inflight is None:
            return


def _pending(seq, inflight: _Step | None) -> int:
    """Tokens of `seq` picked on the device but not yet read by the host (0 or 1)."""
    return int(inflight is not None and seq.finish is None
               and any(s is seq for s in inflight.batch))


def _will_need(seq, pending: int, max_new_tokens: int, max_seq_len: int) -> bool:
    """Will `seq` need another token once its pending one is read (unless that one is
    a stop)? The length and context checks of LLM.generate's `add`."""
    if seq.finish is not None:
        return False
    return len(seq.ids) + pending < max_new_tokens and seq.pos + pending < max_seq_len


def _next_batch(llm, seqs, inflight, max_new_tokens) -> list:
    """The rows of the next step: the sequences that will still need a token (paged),
    or every sequence while any does (the contiguous cache: a row per sequence)."""
    live = [s for s in seqs
            if _will_need(s, _pending(s, inflight), max_new_tokens, llm.max_seq_len)]
    if llm.paged:
        return live
    return list(seqs) if live else []


def _inputs(llm, batch, inflight) -> tuple[torch.Tensor, list[int]]:
    """Tokens [n] of the next step on the device, and its positions: a sequence whose
    last token is still on the device takes it from there, the others (first step,
    finished rows that repeat their last step) from the host."""
    pos = [min(s.pos + _pending(s, inflight), llm.max_seq_len - 1) for s in batch]
    at = {id(s): i for i, s in enumerate(inflight.batch)} if inflight is not None else {}
    src = [at.get(id(s), -1) if _pending(s, inflight) else -1 for s in batch]
    if inflight is not None and src == list(range(len(inflight.batch))):
        return inflight.picks, pos  # the same rows in the same order: the common case
    host = to_device(torch.tensor([s.ids[-1] for s in batch]), llm.device)
    if all(i < 0 for i in src):
        return host, pos
    idx = to_device(torch.tensor(src), llm.device)
    picked = inflight.picks.to(host.dtype)[idx.clamp(min=0)]
    return torch.where(idx >= 0, picked, host), pos


def _read(step: _Step, add) -> None:
    """The host reads a step's tokens (waiting for that step only) and appends them."""
    tokens = step.copy.tolist()
    now = time.perf_counter()
    for s, tok in zip(step.batch, tokens):
        if s.finish is None:
            add(s, tok, now)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the work queued there (pinned,
    non-blocking: a pageable copy makes the host wait for the stream)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """A step's picks copied to the host by a copy queued right behind the pick.

    `picks.tolist()` at read time would queue its copy behind the step launched since,
    and the host would wait for that step too: the loop would fall back to one step at
    a time (an 8-layer H100 run showed ~0.35 ms of idle GPU a token). The copy goes to
    pinned memory with an event after it; reading waits for that event only.
    """

    def __init__(self, picks):
        self.picks, self.host, self.ready = picks, None, None
        if isinstance(picks, torch.Tensor) and picks.device.type == "cuda":
            self.host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
            self.host.copy_(picks, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def tolist(self) -> list:
        if self.ready is None:
            return self.picks.tolist()
        self.ready.synchronize()
        return self.host.tolist()
