"""Choosing the next token (greedy, temperature, top-k, top-p) and turning tokens into text
as they come (holding back an unfinished character or a possible stop string)."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None
           ) -> torch.Tensor:
    """The next token of each row of logits [B, vocab], [B] on the logits' device (the
    host reads it when it needs it): greedy when temperature is 0. `generator` is on the
    same device."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


class TextStream:
    """A sequence's decoded text: what is safe to show, and whether a stop string hit."""

    CONTEXT = 8  # prompt tokens decoded before the new ones, so a leading space survives

    def __init__(self, tokenizer, stops: list[str], prompt: list[int]):
        self.tokenizer, self.stops = tokenizer, stops
        self.context = prompt[-self.CONTEXT:]
        self.context_text = tokenizer.decode(self.context)
        self.text, self.shown, self.stopped = "", 0, False

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` as it reads after the prompt (sentencepiece tokenizers drop
        a leading space when decoding a lone continuation)."""
        full = self.tokenizer.decode(self.context + ids)
        if full.startswith(self.context_text):
            return full[len(self.context_text):]
        return self.tokenizer.decode(ids)

    def update(self, ids: list[int]) -> str:
        """Decode `ids`; return the new text that can be shown."""
        text = self.decode(ids)
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            self.text, self.stopped = text[:min(hits)], True
            return self.flush()
        self.text = text
        safe = len(text) - self._held_back(text)
        new = text[self.shown:safe]
        self.shown = max(self.shown, safe)
        return new

    def flush(self) -> str:
        new = self.text[self.shown:]
        self.shown = len(self.text)
        return new

    def _held_back(self, text: str) -> int:
        """Chars kept back: an unfinished UTF-8 character, or a stop string's start."""
        if text.endswith("\ufffd"):
            return 1
        return max((k for s in self.stops for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
