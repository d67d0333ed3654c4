"""Stop strings: generation ends before the first occurrence, wherever drafts split the text."""

from __future__ import annotations

from typing import Callable, Sequence

from failfast.errors import GenerationInputError


class StopStrings:
    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        if any(not s for s in stops):
            raise GenerationInputError("stop sequences must be non-empty strings")
        self.stops = tuple(stops)
        self.decode = decode

    def find(self, generated: list[int]) -> tuple[int, str] | None:
        """(tokens wholly before the first stop string, text cut exactly before it), or None."""
        text = self.decode(generated)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        keep = 0
        while keep < len(generated) and len(self.decode(generated[: keep + 1])) <= cut:
            keep += 1
        return keep, text[:cut]
