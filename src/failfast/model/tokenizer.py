"""Thin wrapper over a `tokenizers` tokenizer.json: text <-> token ids."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from failfast.errors import CheckpointError


class Tokenizer:
    def __init__(self, inner: _HFTokenizer) -> None:
        self.inner = inner

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        try:
            return cls(_HFTokenizer.from_file(str(path)))
        except Exception as exc:  # the tokenizers library raises a bare Exception
            raise CheckpointError(f"cannot read tokenizer {path}: {exc}") from None

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids, skip_special_tokens=False)
