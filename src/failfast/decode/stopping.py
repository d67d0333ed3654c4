"""Stop strings: generation ends before the first occurrence, wherever drafts split the text.

One `StopStrings` follows one growing output. Each round decodes only the tokens that can
hold an occurrence not seen before (the new tokens and the longest stop string's byte length
before them, plus a split UTF-8 character), so the search stays linear in the output length;
a hit is then confirmed and cut on the full text, once.
"""

from __future__ import annotations

from typing import Callable, Sequence

from failfast.errors import GenerationInputError

_UTF8_TAIL = 4  # tokens: an occurrence hidden by a split multi-byte character at the last check


class StopStrings:
    def __init__(self, stops: Sequence[str], decode: Callable[[list[int]], str]) -> None:
        if any(not s for s in stops):
            raise GenerationInputError("stop sequences must be non-empty strings")
        self.stops = tuple(stops)
        self.decode = decode
        # every token is at least one byte, so an occurrence spans at most this many tokens
        self._reach = max((len(s.encode()) for s in self.stops), default=0) + _UTF8_TAIL
        self._checked = 0  # tokens of the output searched so far

    def find(self, generated: list[int]) -> tuple[int, str] | None:
        """(tokens wholly before the first stop string, text cut exactly before it), or None.
        `generated` must extend the list of the previous call."""
        start = max(0, self._checked - self._reach)
        self._checked = len(generated)
        window = self.decode(generated[start:])
        if not any(s in window for s in self.stops):
            return None
        return self._cut(generated, start)

    def _cut(self, generated: list[int], start: int) -> tuple[int, str] | None:
        text = self.decode(generated)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        cut = min(hits)
        keep = start  # the occurrence begins in the window, so no earlier token reaches it
        while keep < len(generated) and len(self.decode(generated[: keep + 1])) <= cut:
            keep += 1
        return keep, text[:cut]
