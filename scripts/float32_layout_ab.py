"""Interleaved A/B of float32 weight layouts on this CPU: row-major weights (`load_model`
without the column-major layout of `model/packed.py`) against the runtime's column-major
ones, for plain AR and FailFast; `--int8` adds FailFast with an int8 drafter (README,
"Float32 on a CPU without native bf16" and "Int8 drafters"). Tokens must be identical.

    python scripts/float32_layout_ab.py [--prompts 8] [--repeats 2] [--max-new-tokens 128] [--int8]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch

import failfast.model.packed as packed
from failfast.bench.datasets import load_dataset
from failfast.decode.policies import drafter_failfast
from failfast.pipeline import Pipeline


def pipelines(column_major: bool, int8: bool) -> dict[str, Pipeline]:
    """Plain AR and FailFast in float32, loaded with or without the column-major layout."""
    with mock.patch.object(packed, "packs_column_major", packed.packs_column_major if column_major else lambda w: False):
        arms = {"ar": Pipeline.load("target", dtype=torch.float32),
                "failfast": Pipeline.load("target", "dllm-drafter", drafter_failfast(), dtype=torch.float32)}
        if int8:
            arms["failfast int8 drafter"] = Pipeline.load("target", "dllm-drafter", drafter_failfast(),
                                                          dtype=torch.float32, drafter_int8=True)
    return arms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layouts = {"row-major": pipelines(False, args.int8), "column-major": pipelines(True, args.int8)}
    prompts = load_dataset("heldout", args.prompts)
    for arms in layouts.values():  # warm-up
        for pipe in arms.values():
            pipe.generate(prompts[0].text, 16)
    seconds = {(layout, arm): 0.0 for layout, arms in layouts.items() for arm in arms}
    tokens = dict.fromkeys(seconds, 0)
    outputs: dict[str, set[tuple[int, ...]]] = {}
    for _ in range(args.repeats):
        for prompt in prompts:
            for layout, arms in layouts.items():
                for arm, pipe in arms.items():
                    start = time.perf_counter()
                    result = pipe.generate(prompt.text, args.max_new_tokens)
                    seconds[(layout, arm)] += time.perf_counter() - start
                    tokens[(layout, arm)] += len(result.token_ids)
                    outputs.setdefault(prompt.id, set()).add(tuple(result.token_ids))
    for (layout, arm), s in seconds.items():
        print(f"{layout:13s} {arm:22s} {tokens[(layout, arm)] / s:7.1f} tok/s")
    print("tokens identical in every arm:", all(len(o) == 1 for o in outputs.values()))


if __name__ == "__main__":
    main()
