"""Text deltas of a growing output that never have to be taken back.

A running row's tokens can still lose their tail: a stop string completed by a later round
cuts the output before it, and a token may end inside a multi-byte character. So a delta
holds back the last `len(longest stop) - 1` characters (where an unfinished stop string
could begin) and any trailing replacement character; the final delta is the rest of the
result's text. Concatenated deltas are exactly the final text.
"""

from __future__ import annotations

from typing import Callable, Sequence

_REPLACEMENT = "\ufffd"  # what a decoder shows for a character split between tokens


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] = ()) -> None:
        self.decode = decode
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""

    def update(self, generated: list[int]) -> str:
        """New text safe to send, given a running row's tokens so far."""
        text = self.decode(generated).rstrip(_REPLACEMENT)
        safe = text[:len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, text: str) -> str:
        """The rest of a finished row's text."""
        if not text.startswith(self.sent):  # only if decoding were not prefix-stable
            raise RuntimeError("streamed text is not a prefix of the final text")
        return text[len(self.sent):]
