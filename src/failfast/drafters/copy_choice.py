"""Copy or model draft: chosen per round by measured speed (docs/design.md, "Prompt lookup").

A copied continuation costs no drafting pass, but how often it is right depends on the
target: the embedded target's greedy loops make even a 1-token match a good bet, while a
fluent target rarely repeats itself exactly and the model drafter's draft would win.
`CopyChoice` measures instead of guessing: committed tokens per second of the rounds that
drafted a copy (per length of the matched n-gram) and of the rounds the model drafter
drafted, each round timed from its `begin` to the next. A copy is drafted when its
match length has measured at least as fast as the model drafter.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

from failfast.drafters.base import common_prefix_len

MODEL_ROUND = 0  # the arm of model-drafted rounds; copy rounds are keyed by their match length >= 1
# Older rounds count less: each new round of an arm scales its earlier tallies by this, so a
# rate follows the text (about the last 1 / (1 - DECAY) rounds of that arm).
DECAY = 0.9
# Every this many choices, the arm that measured slower is drafted anyway, so that its rate
# is not frozen at an unlucky early value.
EXPLORE_EVERY = 10


@dataclass
class ArmTally:
    """Decayed sums of committed tokens and seconds of one kind of round."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens = self.tokens * DECAY + tokens
        self.seconds = self.seconds * DECAY + seconds

    @property
    def rate(self) -> float:
        """Committed tokens per second; unmeasured arms are infinitely fast (try them first)."""
        return self.tokens / self.seconds if self.seconds > 0 else math.inf


class CopyChoice:
    """Measured rates of copy rounds (by match length) and model rounds, and the choice
    between them. One instance may serve several sequences in turn (a batch's slots share
    it: the rates belong to the model pair and the machine, not to a sequence)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.tallies: dict[int, ArmTally] = {}
        self._choices = 0

    def rate(self, arm: int) -> float:
        return self.tallies[arm].rate if arm in self.tallies else math.inf

    def prefer_copy(self, match: int) -> bool:
        """Whether a round that found a `match`-token n-gram should draft the copy."""
        self._choices += 1
        copy_wins = self.rate(match) >= self.rate(MODEL_ROUND)
        return copy_wins != (self._choices % EXPLORE_EVERY == 0)

    def record(self, arm: int, tokens: int, seconds: float) -> None:
        self.tallies.setdefault(arm, ArmTally()).add(tokens, seconds)


class TimedRound:
    """One sequence's open round: which arm drafted what, from which committed sequence and
    when; `settle` at the next round's start credits its arm with the round's outcome."""

    def __init__(self, choice: CopyChoice, arm: int, committed: list[int]) -> None:
        self.choice = choice
        self.arm = arm
        self.committed = list(committed)
        self.drafted: list[int] = []  # extended by the drafter as it serves the round's tokens
        self.started = choice.clock()

    def settle(self, committed: list[int]) -> None:
        """Record the round if `committed` is exactly it plus its outcome: the accepted draft
        tokens and one target token (or only the accepted ones, when the policy verified a
        prefix and the target's token matched the next drafted one). Rounds the engine ran
        without drafting in between (a speculation gate's plain rounds), or a different
        sequence (a vLLM row's next request), leave the tallies alone."""
        before = len(self.committed)
        if committed[:before] != self.committed:
            return
        grown = len(committed) - before
        accepted = common_prefix_len(committed[before:], self.drafted)
        if accepted <= grown <= accepted + 1 and grown > 0:
            self.choice.record(self.arm, grown, self.choice.clock() - self.started)
