"""Text <-> token ids: a checkpoint's tokenizer.json (via `tokenizers`), or bytes.

The byte tokenizer stands in for models with random weights, which have no
tokenizer: each UTF-8 byte is its own token id.
"""

from __future__ import annotations

from pathlib import Path

from kiln.errors import CheckpointError


class Tokenizer:
    """A Hugging Face fast tokenizer read from tokenizer.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception
            raise CheckpointError(f"cannot read {path.name}: {e}", where=str(path)) from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        """Ids for `text`, with the special tokens the tokenizer adds (BOS for Llama)."""
        return self._tok.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class ByteTokenizer:
    """UTF-8 bytes as token ids; ids past 255 decode as <id>."""

    path = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            out.append(f"<{i}>")
            run = bytearray()
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_id(self, token: str) -> int | None:
        b = token.encode("utf-8")
        return b[0] if len(b) == 1 else None


def load_tokenizer(checkpoint: Path) -> Tokenizer | None:
    """The checkpoint's tokenizer.json, or None when it has none."""
    path = Path(checkpoint) / "tokenizer.json"
    return Tokenizer(path) if path.is_file() else None
