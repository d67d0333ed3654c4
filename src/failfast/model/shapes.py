"""Forward shapes drawn from a few buckets, so that a GPU can capture each shape once
(CUDA graphs) instead of meeting a new one every round (docs/design.md, "Capture-friendly
shapes"). On a CPU the padding is pure cost, so the engine pads only when asked."""

from __future__ import annotations


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def token_bucket(n: int) -> int:
    """Tokens of a padded verification forward (or width of its attention rows): 1, 2, 4, 8,
    then a multiple of 8 up to 64, of 64 up to 1,024, of 256 beyond; 38 buckets up to 4,096
    tokens (one-row plain decoding keeps its one token)."""
    if n < 1:
        raise ValueError(f"a forward needs at least one token, got {n}")
    if n <= 8:
        return 1 << (n - 1).bit_length()
    return _round_up(n, 8 if n <= 64 else 64 if n <= 1024 else 256)


def key_bucket(n: int, capacity: int) -> int:
    """Keys a padded forward reads: the next power of two >= n (at least 64), at most the
    cache capacity. Keys past a row's end are masked, so they change no result."""
    if n > capacity:
        raise ValueError(f"positions up to {n} exceed the cache capacity {capacity}")
    return min(max(64, 1 << (n - 1).bit_length()), capacity)
