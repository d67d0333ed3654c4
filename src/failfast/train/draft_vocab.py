"""A drafter's reduced vocabulary: the tokens the target itself writes most.

The output head is half of a small drafter's pass (8192 rows against two 256-wide layers),
and most rows are tokens the target rarely emits. Keeping the `size` most frequent tokens of
the target's self-distilled continuations shrinks the head by `vocab / size` and costs only
drafts of the rare rest, which verification would reject or the target commits itself
(docs/design.md, "Draft vocabulary"). Written as `draft_vocab.json` next to the drafter's
weights; `make_drafter` uses it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from failfast.drafters.factory import DRAFT_VOCAB_FILE
from failfast.errors import FailfastError
from failfast.train.selfdistill import MANIFEST_FILE, load_rows


def write_draft_vocab(rows_dir: Path, drafter_dir: Path, size: int) -> dict:
    """Count the target-written tokens of `rows_dir`, keep the `size` most frequent, and
    write them (with the share of target tokens they cover) into `drafter_dir`."""
    rows = load_rows(rows_dir)
    prompt_len = json.loads((Path(rows_dir) / MANIFEST_FILE).read_text())["settings"]["prompt_len"]
    written = rows[:, prompt_len:].reshape(-1)
    counts = torch.bincount(written)
    if not 1 <= size <= counts.numel():
        raise FailfastError(f"draft vocabulary size must be in [1, {counts.numel()}], got {size}")
    top = torch.topk(counts, size).indices
    coverage = counts[top].sum().item() / written.numel()
    out = {"ids": sorted(top.tolist()), "size": size, "coverage": round(coverage, 6),
           "source": str(rows_dir), "target_tokens_counted": written.numel()}
    (Path(drafter_dir) / DRAFT_VOCAB_FILE).write_text(json.dumps(out) + "\n")
    return out
