"""Prompt lookup in front of a model drafter (docs/design.md, "Prompt lookup").

Text repeats itself: a name, a call, a line pattern, and a small model's greedy loops. When
the last few committed tokens occurred earlier in the sequence, the tokens that followed
them there are a draft that costs no forward. `LookupDrafter` drafts such a copy, with
confidence 1.0, and lets its model drafter (if any) draft the rounds where nothing matches.
Verification decides as for any draft, so the output is unchanged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import Tensor

from failfast.decode.policies import FailFastDefaults, drafter_defaults
from failfast.decode.sampling import Sampler
from failfast.drafters.base import Drafter
from failfast.errors import PolicyError
from failfast.model.kv_cache import KVCache

COPY_CONFIDENCE = 1.0  # a copied token is not predicted: the policy asks for the whole copy


@dataclass(frozen=True)
class LookupSettings:
    """The longest suffix of `max_ngram` down to `min_ngram` tokens that occurred before is
    matched; up to `max_tokens` of what followed it are copied per round. Defaults measured
    on the embedded models (README, "Prompt lookup")."""

    min_ngram: int = 1
    max_ngram: int = 4
    max_tokens: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise PolicyError(f"lookup n-grams need 1 <= min <= max, got {self.min_ngram} and {self.max_ngram}")
        if self.max_tokens < 1:
            raise PolicyError(f"lookup max tokens must be >= 1, got {self.max_tokens}")


class NgramIndex:
    """Where each n-gram of a growing sequence last occurred with a known continuation."""

    def __init__(self, settings: LookupSettings) -> None:
        self.settings = settings
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest indexed occurrence
        self.tokens: list[int] = []  # the indexed sequence: n-grams ending before its last token are indexed

    def continuation(self, seq: list[int]) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
        matching suffix of `seq`; a copy that reaches the end of `seq` goes on with itself (a
        loop repeats). Empty when nothing matches. A `seq` that extends the last one is indexed
        incrementally; any other starts the index over (a vLLM batch row's next request)."""
        s = self.settings
        if seq[:len(self.tokens)] != self.tokens:
            self.ends, self.tokens = {}, []
        for end in range(max(len(self.tokens), 1), len(seq)):  # n-grams whose next token is known now
            for n in range(s.min_ngram, min(s.max_ngram, end) + 1):
                self.ends[tuple(seq[end - n:end])] = end
        self.tokens += seq[len(self.tokens):]
        for n in range(min(s.max_ngram, len(seq) - 1), s.min_ngram - 1, -1):
            start = self.ends.get(tuple(seq[len(seq) - n:]))
            if start is not None:
                copied: list[int] = []
                for i in range(start, start + s.max_tokens):
                    copied.append(seq[i] if i < len(seq) else copied[i - len(seq)])
                return copied
        return []


class LookupDrafter:
    """Drafts a copied continuation where the sequence repeats itself, else its `inner`
    model drafter's tokens: a round's draft is one or the other.

    Letting the model drafter continue a copy measured slower (README, "Prompt lookup"):
    its passes and the extra verified tokens cost more than they won, and a drafter that
    reads the target's features has none for copied positions anyway. Without an inner
    drafter this is prompt lookup alone (vLLM's `ngram` method). Batches run the inner
    drafters' passes of the rows without a copy together.
    """

    def __init__(self, inner: Drafter | None, settings: LookupSettings = LookupSettings()) -> None:
        self.inner = inner
        self.settings = settings
        self.copied = 0  # tokens drafted by copying (cumulative)
        self._index = NgramIndex(settings)
        self._copy: list[int] = []
        self._served = 0

    # what the engine reads of its drafter, from the inner one
    @property
    def forwards(self) -> int:
        return self.inner.forwards if self.inner is not None else 0

    @property
    def batchable(self) -> bool:
        return getattr(self.inner, "batchable", False)

    @property
    def model(self):
        return self.inner.model  # type: ignore[union-attr]

    @property
    def target_layers(self) -> tuple[int, ...]:
        return getattr(self.inner, "target_layers", ())

    @property
    def failfast_defaults(self) -> FailFastDefaults:
        """The inner drafter's FailFast settings; alone, chunks of a whole copy."""
        if self.inner is None:
            return FailFastDefaults(chunk=self.settings.max_tokens)
        return drafter_defaults(self.inner)

    def batch_capacity(self, positions: int) -> int:
        return self.inner.batch_capacity(positions)  # type: ignore[union-attr]

    def add_context(self, start: int, features: Tensor) -> None:
        self.inner.add_context(start, features)  # type: ignore[union-attr]

    def __copy__(self) -> "LookupDrafter":
        """A batch slot's copy: its own inner drafter and index (`prepare` resets both)."""
        return LookupDrafter(copy.copy(self.inner) if self.inner is not None else None, self.settings)

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        self._index = NgramIndex(self.settings)
        if self.inner is not None:
            if cache is not None:
                self.inner.prepare(total_len, cache=cache)  # type: ignore[call-arg]
            else:
                self.inner.prepare(total_len)

    def sample_with(self, sampler: Sampler | None) -> None:
        if self.inner is not None:
            self.inner.sample_with(sampler)

    def begin(self, committed: list[int]) -> None:
        self._copy = self._index.continuation(committed)
        self._served = 0
        if self._drafts_with_inner:
            self.inner.begin(committed)  # type: ignore[union-attr]

    def _take_copy(self, count: int) -> tuple[list[int], list[float]]:
        """The copy's next `count` tokens (fewer at its end) and their confidences."""
        tokens = self._copy[self._served:self._served + count]
        self._served += len(tokens)
        self.copied += len(tokens)
        return tokens, [COPY_CONFIDENCE] * len(tokens)

    @property
    def _drafts_with_inner(self) -> bool:
        """Whether this round's draft comes from the inner drafter (nothing to copy)."""
        return self.inner is not None and not self._copy

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        if self._drafts_with_inner:
            return self.inner.draft(count)  # type: ignore[union-attr]
        return self._take_copy(count)

    @staticmethod
    def draft_rows(drafters: list["LookupDrafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """`draft` for every slot in `wants`: copies, and the rows without one draft with their
        inner drafters in one batched call."""
        out: dict[int, tuple[list[int], list[float]]] = {}
        inner_wants: dict[int, int] = {}
        for slot, count in wants.items():
            d = drafters[slot]
            if d._drafts_with_inner:
                inner_wants[slot] = count
            else:
                out[slot] = d._take_copy(count)
        if inner_wants:
            inners = [d.inner for d in drafters]
            out.update(type(inners[next(iter(inner_wants))]).draft_rows(inners, inner_wants, shared))
        return out
