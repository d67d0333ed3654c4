"""How many tokens to draft: a policy sees the confidences drafted so far and asks for more."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from failfast.decode.costs import CostProfile, measure_costs
from failfast.errors import PolicyError

if TYPE_CHECKING:
    from failfast.drafters import Drafter
    from failfast.model import LoadedModel


class Policy(Protocol):
    name: str

    def request(self, confidences: list[float]) -> int:
        """How many more tokens to draft given this round's confidences so far; 0 stops."""


# Builds a policy from the loaded target and drafter and the first request's prompt ids (the
# engine calls it once, before that request): for policies that measure this machine.
PolicyFactory = Callable[["LoadedModel", "Drafter", list[int]], Policy]


def is_policy_factory(policy: "Policy | PolicyFactory") -> bool:
    return not hasattr(policy, "request")


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
    chunk: int = 8  # the drafter's sub-block: one denoising pass per chunk (README, "Choosing the drafting defaults")
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


@dataclass(frozen=True)
class CostAware:
    """FailFast's chunked loop with a measured stop rule, for machines where long drafts are
    not free to verify (CPUs).

    A drafted token's confidence stands for its chance of acceptance, so the draft so far is
    worth an expected `1 + sum_i prod_{j<=i} c_j` committed tokens. Draft another chunk only
    if the round's expected tokens per millisecond (drafting plus verifying, from `costs`)
    rise with it; the chunk's confidences are assumed to be the last chunk's geometric mean.
    """

    costs: CostProfile
    chunk: int = 8
    max_draft: int = 60

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.chunk > self.max_draft:
            raise PolicyError(f"need 1 <= chunk N <= max draft N_max, got N={self.chunk}, N_max={self.max_draft}")

    @property
    def name(self) -> str:
        return f"cost-aware(N={self.chunk}, N_max={self.max_draft})"

    def _rate(self, drafted: int, expected: float) -> float:
        spent = drafted * self.costs.draft_ms_per_token + self.costs.verify_ms(drafted + 1)
        return (1 + expected) / spent

    def request(self, confidences: list[float]) -> int:
        if not confidences:
            return self.chunk
        m = len(confidences)
        more = min(self.chunk, self.max_draft - m)
        if more <= 0:
            return 0
        expected, survive = 0.0, 1.0
        for c in confidences:
            survive *= c
            expected += survive
        recent = confidences[-self.chunk:]
        q = math.prod(recent) ** (1 / len(recent))
        gain = survive * sum(q ** i for i in range(1, more + 1))
        return more if self._rate(m + more, expected + gain) > self._rate(m, expected) else 0


def cost_aware(chunk: int = 8, max_draft: int = 60) -> PolicyFactory:
    """CostAware with costs measured on the loaded models after the first request's prompt."""
    def build(target: "LoadedModel", drafter: "Drafter", prompt_ids: list[int]) -> Policy:
        return CostAware(measure_costs(target, drafter, prompt_ids), chunk=chunk, max_draft=max_draft)
    return build
