"""Chance that a drafted token is accepted, learned from earlier rounds' verifications.

A drafter's confidence is not its acceptance rate: the embedded block-diffusion drafter's
confident-looking tails are rejected more often, and its unsure tokens are accepted more
often, than the confidence says. A policy that trades verification cost against expected
accepted tokens needs the real rate, so this keeps per-confidence-bin counts of how often a
token that was reached (every earlier token of its draft accepted) was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCalibrator:
    """Acceptance rate by confidence bin; each bin starts at its centre with `prior` pseudo-counts."""

    bins: int = 10
    prior: float = 4.0
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.bins < 1 or self.prior <= 0:
            raise ValueError(f"need bins >= 1 and prior > 0, got bins={self.bins}, prior={self.prior}")
        if not self.reached:
            self.reached = [self.prior] * self.bins
            self.accepted = [self.prior * (b + 0.5) / self.bins for b in range(self.bins)]

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.bins), 0), self.bins - 1)

    def probability(self, confidence: float) -> float:
        b = self._bin(confidence)
        return self.accepted[b] / self.reached[b]

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A verified draft with these confidences had its first `accepted` tokens accepted."""
        for i, c in enumerate(confidences[:accepted + 1]):
            b = self._bin(c)
            self.reached[b] += 1
            self.accepted[b] += i < accepted
