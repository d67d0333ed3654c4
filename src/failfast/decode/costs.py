"""What a speculative round costs on this machine, measured: verifying k tokens, drafting one.

On a GPU, verifying 60 tokens costs about as much as verifying one; on a small CPU it does
not, so a controller that sizes drafts by cost needs the real curve. `measure_costs` times
the target and drafter on the models and device at hand in about a second.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from statistics import median
from typing import Callable

import torch

from failfast.drafters import Drafter
from failfast.model import LoadedModel

VERIFY_POINTS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class CostProfile:
    """Milliseconds of one target forward over k tokens (measured points, interpolated
    linearly between them and extended linearly past the last) and of one drafted token."""

    verify_points: tuple[tuple[int, float], ...]
    draft_ms_per_token: float

    def __post_init__(self) -> None:
        ks = [k for k, _ in self.verify_points]
        if len(ks) < 2 or ks != sorted(set(ks)) or ks[0] < 1:
            raise ValueError("verify_points needs at least two increasing draft sizes >= 1")
        if self.draft_ms_per_token < 0 or any(ms <= 0 for _, ms in self.verify_points):
            raise ValueError("costs must be positive")

    def verify_ms(self, k: int) -> float:
        pts = self.verify_points
        if k <= pts[0][0]:
            return pts[0][1]
        for (k0, ms0), (k1, ms1) in zip(pts, pts[1:]):
            if k <= k1:
                break  # else the last segment extends past the last point
        return ms0 + (ms1 - ms0) * (k - k0) / (k1 - k0)


def _interleaved_median_ms(fns: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median ms of each function, timed in turn `repeats` times after one warm-up each, so
    a burst of load on the machine spreads over all of them instead of skewing one."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t0)
    return [1e3 * median(spent) for spent in times]


@torch.inference_mode()
def measure_costs(target: LoadedModel, drafter: Drafter, prompt_ids: list[int], *,
                  draft_tokens: int = 16, repeats: int = 5, chunk: int | None = None) -> CostProfile:
    """Time target forwards of `VERIFY_POINTS` tokens after the prompt, and a `draft_tokens`
    draft after it in steady state (the warm-up fills the drafter's cache with the prompt,
    as earlier rounds of a generation do), asked for `chunk` tokens at a time as the policy
    will ask (a sliding block-diffusion window drafts one request per pass). A block drafter
    that drafts `tokens_per_pass` at once is timed on one pass (a second pass for one more
    token would double the estimate). The drafter drafts greedily here, so a chain drafter runs
    each request's steps in one call ("Greedy chains in one call" in docs/design.md): a
    generation that samples or penalizes drafts step by step and pays more per token."""
    # behind prompt lookup, time the model drafter: copies cost nothing, and the first prompt
    # may hold none or many of them
    drafter = getattr(drafter, "inner", None) or drafter
    draft_tokens = getattr(drafter, "tokens_per_pass", draft_tokens)
    model = target.model
    n = len(prompt_ids)
    cache = model.new_cache(n + max(VERIFY_POINTS))
    taps = getattr(drafter, "target_layers", ())  # a DFlash drafter drafts from the prompt's features
    out = model(torch.tensor([prompt_ids], device=model.device), 0, cache, logits_at=slice(0, 0), taps=taps)

    def verify(k: int) -> Callable[[], None]:
        tokens = torch.tensor([prompt_ids[-1:] * k], device=model.device)

        def run() -> None:
            cache.rollback(n)
            model(tokens, n, cache)
        return run
    drafter.prepare(n + draft_tokens)
    if taps:
        drafter.add_context(0, out[1][0, :n - 1])  # type: ignore[attr-defined]

    def draft() -> None:
        drafter.begin(list(prompt_ids))
        drafted = 0
        while drafted < draft_tokens and (new := drafter.draft(min(draft_tokens - drafted, chunk or draft_tokens))[0]):
            drafted += len(new)
    *verify_ms, draft_ms = _interleaved_median_ms([verify(k) for k in VERIFY_POINTS] + [draft], repeats)
    return CostProfile(tuple(zip(VERIFY_POINTS, verify_ms)), draft_ms / draft_tokens)
