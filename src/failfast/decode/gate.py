"""Whether a round should speculate at all, learned from the rounds' own wall-clock rates.

Speculation trades target compute for fewer forwards. With one row on a CPU, or many rows on
a GPU, a forward's cost hardly grows with its width and drafts pay; with many rows on a CPU
the batch already fills the machine, every verified draft token costs about as much as a
committed one, and plain rounds are faster (README, "Batch jobs"). Where that happens depends
on the machine, the models and the drafter's acceptance, so the gate measures instead of
guessing: for each batch-size bucket it keeps a moving average of committed tokens per
second of speculative rounds and of plain rounds, runs the faster kind and probes the other
now and then, so a change (rows finishing, harder text) is noticed (docs/design.md,
"Speculation gate"). The output never changes: a plain round is a round with an empty draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from failfast.errors import PolicyError


def batch_bucket(rows: int) -> int:
    """Rows rounded down to a power of two: rates are kept per bucket, not per exact size."""
    return 1 << (max(rows, 1).bit_length() - 1)


@dataclass
class _Arm:
    rate: float = 0.0   # moving average of committed tokens per second
    rounds: int = 0


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    since_probe: int = 0
    interval: int = 0  # leader rounds between probes (0: not set yet)


@dataclass
class SpeculationGate:
    """Speculate in a round only where speculative rounds have been measured faster.

    Each bucket first runs `warmup` rounds of each kind (speculative first), then the kind
    with the higher average rate, and one round of the other kind (a probe) after
    `probe_every` rounds. A probe costs a slow round, so each probe that leaves the leader in
    place doubles the wait before the next one, up to `max_probe_every`; a probe that changes
    the leader resets it. `smoothing` is the weight of the newest round in each average.
    """

    warmup: int = 2
    probe_every: int = 16
    max_probe_every: int = 256
    smoothing: float = 0.2
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.warmup < 1 or not 1 <= self.probe_every <= self.max_probe_every
                or not 0 < self.smoothing <= 1):
            raise PolicyError(f"need warmup >= 1, 1 <= probe_every <= max_probe_every and 0 < smoothing <= 1, got "
                              f"{self.warmup}, {self.probe_every}, {self.max_probe_every}, {self.smoothing}")

    def speculate(self, rows: int) -> bool:
        """Whether the next round of `rows` rows drafts."""
        bucket = self.buckets.setdefault(batch_bucket(rows), _Bucket())
        for kind in (True, False):
            if bucket.arms[kind].rounds < self.warmup:
                return kind
        best = bucket.arms[True].rate >= bucket.arms[False].rate
        if bucket.since_probe >= (bucket.interval or self.probe_every):
            return not best
        return best

    def record(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A finished round of `rows` rows committed `tokens` tokens in `seconds`."""
        bucket = self.buckets.setdefault(batch_bucket(rows), _Bucket())
        warming = min(a.rounds for a in bucket.arms.values()) < self.warmup
        leader = bucket.arms[True].rate >= bucket.arms[False].rate
        probe = not warming and speculated != leader
        bucket.since_probe = 0 if warming or probe else bucket.since_probe + 1
        arm = bucket.arms[speculated]
        rate = tokens / max(seconds, 1e-9)
        # a warm-up round replaces the average (the first round of a new shape pays one-off costs)
        arm.rate = rate if arm.rounds < self.warmup else (1 - self.smoothing) * arm.rate + self.smoothing * rate
        arm.rounds += 1
        if probe:
            kept = leader == (bucket.arms[True].rate >= bucket.arms[False].rate)
            bucket.interval = min(2 * (bucket.interval or self.probe_every), self.max_probe_every) if kept \
                else self.probe_every
