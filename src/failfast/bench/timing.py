"""Side-by-side timing: methods interleaved within each repeat, after a warm-up; medians."""

from __future__ import annotations

import statistics
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def interleaved_runs(methods: dict[str, Callable[[], T]], repeats: int, warmup: int = 1, rotation: int = 0
                     ) -> tuple[dict[str, list[float]], dict[str, T]]:
    """Wall seconds of every repeat per method, and each method's last output.

    Interleaving puts every method under the same machine conditions (thermal state,
    background load), so their ratio is meaningful even when absolute times drift. Repeat r
    runs the methods in their order rotated by `rotation + r`, so that no method always
    follows the same one (whose weights it would find in or evict from the cache).
    """
    outputs: dict[str, T] = {}
    for _ in range(warmup):
        for name, fn in methods.items():
            outputs[name] = fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(repeats):
        shift = (rotation + r) % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            outputs[name] = methods[name]()
            times[name].append(time.perf_counter() - start)
    return times, outputs


def median(values: list[float]) -> float:
    return statistics.median(values)
