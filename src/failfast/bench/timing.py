"""Side-by-side timing: methods interleaved within each repeat, after a warm-up; medians."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def interleaved_runs(methods: dict[str, Callable[[], T]], repeats: int, warmup: int = 1
                     ) -> tuple[dict[str, list[float]], dict[str, T]]:
    """Wall seconds of every repeat per method, and each method's last output.

    Interleaving puts every method under the same machine conditions (thermal state,
    background load), so their ratio is meaningful even when absolute times drift.
    """
    outputs: dict[str, T] = {}
    for _ in range(warmup):
        for name, fn in methods.items():
            outputs[name] = fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    return times, outputs


def median(values: list[float]) -> float:
    return statistics.median(values)
