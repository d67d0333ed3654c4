"""Progress for long jobs: a live rich bar in a terminal, a plain line every 5% in a log file
(rich draws nothing there until the job ends)."""

from __future__ import annotations

import time

from rich.progress import Progress


def log_milestone(bar: Progress, done: int, total: int, started: float, text: str) -> None:
    """Print `text` with the count and elapsed time when output is not a terminal and `done`
    crosses a 5% step (or the end)."""
    if bar.console.is_terminal or not (done % max(total // 20, 1) == 0 or done == total):
        return
    bar.console.print(f"{done}/{total} {text} ({(time.perf_counter() - started) / 60:.1f} min)")
