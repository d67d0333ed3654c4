"""Oracle drafter (benchmarks only): already knows the target's continuation, costs nothing.

It bounds what any drafter could achieve: every draft is accepted, so the remaining cost
is verification alone.
"""

from __future__ import annotations

from failfast.decode.sampling import Sampler


class OracleDrafter:
    def __init__(self, prompt_len: int, continuation: list[int]) -> None:
        self.prompt_len = prompt_len
        self.continuation = continuation
        self.forwards = 0  # free by definition
        self._next = 0

    def prepare(self, total_len: int) -> None:
        self._next = 0

    def sample_with(self, sampler: Sampler | None) -> None:
        """The oracle drafts the target's own continuation, whatever the sampling."""

    def begin(self, committed: list[int]) -> None:
        self._next = len(committed) - self.prompt_len

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        tokens = self.continuation[self._next:self._next + count]
        self._next += len(tokens)
        return tokens, [1.0] * len(tokens)
