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
    rate: float = 0.0   # moving average over samples of committed tokens per second
    samples: int = 0


@dataclass
class _Sample:
    """Consecutive rounds of one kind, measured together: one round of a single row is too
    noisy (a draft is mostly accepted or mostly rejected), so a sample spans enough rounds to
    cover `sample_rows` row-rounds."""
    speculated: bool
    tokens: int = 0
    seconds: float = 0.0
    row_rounds: int = 0


@dataclass
class _Bucket:
    arms: dict[bool, _Arm] = field(default_factory=lambda: {True: _Arm(), False: _Arm()})
    open: _Sample | None = None
    since_probe: int = 0
    interval: int = 0  # leader samples between probes (0: not set yet)


@dataclass
class SpeculationGate:
    """Speculate in a round only where speculative rounds have been measured faster.

    Rounds are measured in samples of one kind covering at least `sample_rows` row-rounds (one
    round of 16 rows; 8 rounds of one row). Each bucket first takes `warmup` samples of each
    kind (speculative first), then runs the kind with the higher average rate, and one sample
    of the other kind (a probe) after `probe_every` samples. A probe is slow, so each probe that
    leaves the leader in place doubles the wait before the next one, up to `max_probe_every`;
    a probe that changes the leader resets it. A probe's rate replaces its kind's stale average;
    `smoothing` is the weight of the newest sample in the leader's average.
    """

    warmup: int = 2
    probe_every: int = 16
    max_probe_every: int = 256
    smoothing: float = 0.2
    sample_rows: int = 8
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.warmup < 1 or not 1 <= self.probe_every <= self.max_probe_every
                or not 0 < self.smoothing <= 1 or self.sample_rows < 1):
            raise PolicyError(f"need warmup >= 1, 1 <= probe_every <= max_probe_every, 0 < smoothing <= 1 and "
                              f"sample_rows >= 1, got {self.warmup}, {self.probe_every}, {self.max_probe_every}, "
                              f"{self.smoothing}, {self.sample_rows}")

    def speculate(self, rows: int) -> bool:
        """Whether the next round of `rows` rows drafts."""
        bucket = self.buckets.setdefault(batch_bucket(rows), _Bucket())
        if bucket.open is not None:  # finish the sample in progress
            return bucket.open.speculated
        for kind in (True, False):
            if bucket.arms[kind].samples < self.warmup:
                return kind
        best = bucket.arms[True].rate >= bucket.arms[False].rate
        if bucket.since_probe >= (bucket.interval or self.probe_every):
            return not best
        return best

    def record(self, rows: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A finished round of `rows` rows committed `tokens` tokens in `seconds`."""
        bucket = self.buckets.setdefault(batch_bucket(rows), _Bucket())
        if bucket.open is None or bucket.open.speculated != speculated:
            bucket.open = _Sample(speculated)
        sample = bucket.open
        sample.tokens += tokens
        sample.seconds += seconds
        sample.row_rounds += rows
        if sample.row_rounds >= self.sample_rows:
            bucket.open = None
            self._close(bucket, sample)

    def _close(self, bucket: _Bucket, sample: _Sample) -> None:
        """Fold a finished sample into its kind's average and schedule the next probe."""
        warming = min(a.samples for a in bucket.arms.values()) < self.warmup
        leader = bucket.arms[True].rate >= bucket.arms[False].rate
        probe = not warming and sample.speculated != leader
        bucket.since_probe = 0 if warming or probe else bucket.since_probe + 1
        arm = bucket.arms[sample.speculated]
        rate = sample.tokens / max(sample.seconds, 1e-9)
        # A warm-up sample replaces the average (the first rounds of a new shape pay one-off
        # costs), and so does a probe: the average it would smooth is as old as the previous
        # probe, possibly from the first, slow rounds of the engine (docs/design.md).
        fresh = arm.samples < self.warmup or probe
        arm.rate = rate if fresh else (1 - self.smoothing) * arm.rate + self.smoothing * rate
        arm.samples += 1
        if probe:
            kept = leader == (bucket.arms[True].rate >= bucket.arms[False].rate)
            bucket.interval = min(2 * (bucket.interval or self.probe_every), self.max_probe_every) if kept \
                else self.probe_every
