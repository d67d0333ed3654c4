"""How many tokens to draft: a policy sees the confidences drafted so far and asks for more."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from failfast.decode.calibration import AcceptanceCalibrator
from failfast.decode.costs import CostProfile, measure_costs
from failfast.errors import PolicyError

if TYPE_CHECKING:
    from failfast.drafters import Drafter
    from failfast.model import LoadedModel


class Policy(Protocol):
    name: str

    def request(self, confidences: list[float]) -> int:
        """How many more tokens to draft given this round's confidences so far; 0 stops."""

    def verify_count(self, confidences: list[float]) -> int:
        """How many of the round's drafted tokens (a prefix) the target verifies."""

    def observe(self, confidences: list[float], accepted: int) -> None:
        """The verified draft's confidences and how many of its tokens were accepted."""


class StatelessRounds:
    """Verify every drafted token and learn nothing from earlier rounds (the papers' rounds)."""

    def verify_count(self, confidences: list[float]) -> int:
        return len(confidences)

    def observe(self, confidences: list[float], accepted: int) -> None:
        pass


# Builds a policy from the loaded target and drafter and the first request's prompt ids (the
# engine calls it once, before that request): for policies that measure this machine.
PolicyFactory = Callable[["LoadedModel", "Drafter", list[int]], Policy]


def is_policy_factory(policy: "Policy | PolicyFactory") -> bool:
    return not hasattr(policy, "request")


@dataclass(frozen=True)
class Fixed(StatelessRounds):
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
class FailFast(StatelessRounds):
    """Paper Algorithm 1: draft `chunk` tokens; while all are confident, draft more, up to `max_draft`."""

    tau: float = 0.45
    chunk: int = 8  # the paper's N; each drafter kind has its own measured default (README, "Choosing the drafting defaults")
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
class FailFastDefaults:
    """A drafter kind's FailFast settings, chosen by measurement (README, "Choosing the
    drafting defaults"): where every verified token costs, a draft should stop at its first
    unsure tokens, so the tuned kinds use a high threshold and a short chunk."""

    tau: float = 0.45
    chunk: int = 8


def drafter_defaults(drafter: "Drafter") -> FailFastDefaults:
    """The drafter's own FailFast settings (`failfast_defaults`), else the paper's tau 0.45
    with chunk 8 (AR drafters)."""
    return getattr(drafter, "failfast_defaults", FailFastDefaults())


def _chunk_for(drafter: "Drafter", chunk: int | None, max_draft: int) -> int:
    """`chunk`, or the drafter's default chunk capped at `max_draft`."""
    return min(drafter_defaults(drafter).chunk, max_draft) if chunk is None else chunk


def failfast_for(drafter: "Drafter", tau: float | None = None, chunk: int | None = None,
                 max_draft: int = 60) -> FailFast:
    """FailFast with the drafter's defaults where tau or chunk N is not given (the default
    chunk is capped at `max_draft`)."""
    return FailFast(drafter_defaults(drafter).tau if tau is None else tau, _chunk_for(drafter, chunk, max_draft),
                    max_draft)


def drafter_failfast(tau: float | None = None, chunk: int | None = None, max_draft: int = 60) -> PolicyFactory:
    """`failfast_for` as a policy factory: the engine builds it with its drafter."""
    def build(target: "LoadedModel", drafter: "Drafter", prompt_ids: list[int]) -> Policy:
        return failfast_for(drafter, tau, chunk, max_draft)
    return build


@dataclass(frozen=True)
class CostAware:
    """FailFast's chunked loop with a measured stop rule, for machines where long drafts are
    not free to verify (CPUs).

    Each drafted token has a chance of acceptance: its confidence, mapped through the
    acceptance rates earlier rounds showed for that confidence (`calibrator`, updated by
    `observe`). The draft so far is worth an expected `1 + sum_i prod_{j<=i} p_j` committed
    tokens. Draft another chunk only if the round's expected tokens per millisecond
    (drafting plus verifying, from `costs`) rise with it; the chunk's chances are assumed
    to be the last chunk's geometric mean. A block drafter's chunk often holds a likely head
    and an unlikely tail, and on a CPU each verified token costs, so only the prefix with
    the best expected tokens per millisecond is verified (`verify_count`).
    """

    costs: CostProfile
    chunk: int = 8
    max_draft: int = 60
    calibrator: AcceptanceCalibrator = field(default_factory=AcceptanceCalibrator, compare=False)

    def __post_init__(self) -> None:
        if self.chunk < 1 or self.chunk > self.max_draft:
            raise PolicyError(f"need 1 <= chunk N <= max draft N_max, got N={self.chunk}, N_max={self.max_draft}")

    @property
    def name(self) -> str:
        return f"cost-aware(N={self.chunk}, N_max={self.max_draft})"

    def _rate(self, drafted: int, expected: float, verified: int) -> float:
        spent = drafted * self.costs.draft_ms_per_token + self.costs.verify_ms(verified + 1)
        return (1 + expected) / spent

    def _chances(self, confidences: list[float]) -> list[float]:
        return [self.calibrator.probability(c) for c in confidences]

    @staticmethod
    def _expected_prefixes(chances: list[float]) -> list[float]:
        """Expected accepted tokens when verifying the first 0, 1, ..., m drafted tokens."""
        expected, survive = [0.0], 1.0
        for p in chances:
            survive *= p
            expected.append(expected[-1] + survive)
        return expected

    def _prefix_rates(self, drafted: int, expected: list[float]) -> list[float]:
        """Expected tokens per ms of the round when verifying each prefix (index = its length)."""
        return [self._rate(drafted, e, length) for length, e in enumerate(expected)]

    def verify_count(self, confidences: list[float]) -> int:
        rates = self._prefix_rates(len(confidences), self._expected_prefixes(self._chances(confidences)))
        return max(range(len(rates)), key=rates.__getitem__)

    def observe(self, confidences: list[float], accepted: int) -> None:
        self.calibrator.observe(confidences, accepted)

    def request(self, confidences: list[float]) -> int:
        if not confidences:
            return self.chunk
        m = len(confidences)
        more = min(self.chunk, self.max_draft - m)
        if more <= 0:
            return 0
        chances = self._chances(confidences)
        expected = self._expected_prefixes(chances)
        survive = expected[-1] - expected[-2]
        recent = chances[-self.chunk:]
        q = math.prod(recent) ** (1 / len(recent))
        gain = survive * sum(q ** i for i in range(1, more + 1))
        now = max(self._prefix_rates(m, expected))
        return more if self._rate(m + more, expected[-1] + gain, m + more) > now else 0


def cost_aware(chunk: int | None = None, max_draft: int = 60) -> PolicyFactory:
    """CostAware with costs measured on the loaded models after the first request's prompt;
    chunk N defaults to the drafter's FailFast chunk (capped at `max_draft`)."""
    def build(target: "LoadedModel", drafter: "Drafter", prompt_ids: list[int]) -> Policy:
        n = _chunk_for(drafter, chunk, max_draft)
        return CostAware(measure_costs(target, drafter, prompt_ids, chunk=n), chunk=n, max_draft=max_draft)
    return build
