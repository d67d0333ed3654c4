"""How many tokens to draft: a policy sees the confidences drafted so far and asks for more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from failfast.errors import PolicyError


class Policy(Protocol):
    name: str

    def request(self, confidences: list[float]) -> int:
        """How many more tokens to draft given this round's confidences so far; 0 stops."""


@dataclass(frozen=True)
class Fixed:
    """Draft exactly k tokens each round (classic speculative decoding)."""

    k: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise PolicyError(f"fixed draft length k must be >= 1, got {self.k}")

    @property
    def name(self) -> str:
        return f"fixed(k={self.k})"

    def request(self, confidences: list[float]) -> int:
        return max(self.k - len(confidences), 0)


@dataclass(frozen=True)
class FailFast:
    """Paper Algorithm 1: draft `chunk` tokens; while all are confident, draft more, up to `max_draft`."""

    tau: float = 0.45
    chunk: int = 10
    max_draft: int = 60

    def __post_init__(self) -> None:
        if not 0 <= self.tau <= 1:
            raise PolicyError(f"tau must be in [0, 1], got {self.tau}")
        if self.chunk < 1 or self.max_draft < 1:
            raise PolicyError(f"chunk N and max draft N_max must be >= 1, got N={self.chunk}, N_max={self.max_draft}")
        if self.chunk > self.max_draft:
            raise PolicyError(f"chunk N ({self.chunk}) must not exceed max draft N_max ({self.max_draft})")

    @property
    def name(self) -> str:
        return f"failfast(tau={self.tau}, N={self.chunk}, N_max={self.max_draft})"

    def request(self, confidences: list[float]) -> int:
        if not confidences:
            return self.chunk
        if len(confidences) >= self.max_draft or min(confidences) < self.tau:
            return 0
        return min(self.chunk, self.max_draft - len(confidences))
