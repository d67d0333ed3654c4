"""Per-generation statistics and the per-round trajectory (docs/design.md, "Engine")."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable


@dataclass
class RoundStats:
    drafted: int  # draft tokens the target verified (a policy may verify only a prefix of its draft)
    accepted: int
    drafter_forwards: int
    confidences: list[float]


@dataclass
class GenerationStats:
    tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafter_forwards: int = 0
    target_forwards: int = 0
    wall_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    trajectory: list[RoundStats] = field(default_factory=list)

    @property
    def other_s(self) -> float:
        return max(self.wall_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def record(self, round_stats: RoundStats) -> None:
        self.rounds += 1
        self.drafted += round_stats.drafted
        self.accepted += round_stats.accepted
        self.drafter_forwards += round_stats.drafter_forwards
        self.trajectory.append(round_stats)

    def to_dict(self, trajectory: bool = False) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "trajectory"}
        out.update(other_s=self.other_s, tokens_per_round=self.tokens_per_round,
                   acceptance_rate=self.acceptance_rate, tokens_per_s=self.tokens_per_s)
        if trajectory:
            out["trajectory"] = [asdict(r) for r in self.trajectory]
        return out


def acceptance_by_position(rounds: Iterable[RoundStats], positions: int = 8) -> list[float | None]:
    """For i = 0..positions-1, the share of rounds whose i-th verified draft token was accepted,
    among the rounds that verified it with every earlier one accepted (None where none did):
    where along a draft a drafter stops predicting the target, what a chunk size or a
    drafter's training should follow."""
    reached, accepted = [0] * positions, [0] * positions
    for r in rounds:
        for i in range(min(r.accepted + 1, r.drafted, positions)):
            reached[i] += 1
            accepted[i] += i < r.accepted
    return [a / n if n else None for a, n in zip(accepted, reached)]
