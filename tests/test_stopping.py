"""The incremental stop-string search finds exactly what a search of the whole text finds."""

from __future__ import annotations

import random
from pathlib import Path

from failfast.decode.stopping import StopStrings
from failfast.model import Tokenizer

TOKENIZER = Tokenizer.from_file(Path(__file__).parents[1] / "src/failfast/models/target/tokenizer.json")
TEXT = ("def résumé(x):\n    return '€' * x  # naïve ✓\n\n\nclass Ünïcode:\n    pass\n"
        "print('日本語', \"😀\")\n    return None\n") * 3


def whole_text_search(generated: list[int], stops: list[str]) -> tuple[int, str] | None:
    """The definition: the first occurrence in the decoded output; tokens wholly before it."""
    text = TOKENIZER.decode(generated)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if not hits:
        return None
    cut = min(hits)
    keep = 0
    while keep < len(generated) and len(TOKENIZER.decode(generated[: keep + 1])) <= cut:
        keep += 1
    return keep, text[:cut]


def test_incremental_search_equals_whole_text_search():
    ids = TOKENIZER.encode(TEXT)
    rng = random.Random(0)
    cases = [["\n\n\n"], ["€' *"], ["😀"], ["日本"], ["return None"], ["Ün", "✓"], ["not in the text"], ["ïcode:\n"]]
    for stops in cases:
        for trial in range(20):
            stopper, generated, got = StopStrings(stops, TOKENIZER.decode), [], None
            want = None
            while len(generated) < len(ids) and got is None:
                generated = ids[:len(generated) + rng.randint(1, 12)]  # rounds commit 1..12 tokens
                got = stopper.find(generated)
                want = whole_text_search(generated, stops)
                assert got == want, (stops, trial, len(generated))
            if stops != ["not in the text"]:
                assert got is not None and not any(s in got[1] for s in stops)
