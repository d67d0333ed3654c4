"""Interleaved A/B of two checkpoints of one drafter: does a training pass pay?

Loads plain AR and, for each checkpoint, FailFast over it (the drafter kind's defaults) and
one fixed draft length; runs them one after another on every prompt (after a warm-up), checks
that every method gives plain AR's tokens, and prints the median (and geometric-mean) speedup
over plain AR and the tokens per target forward of each.

    python scripts/drafter_ab.py OLD NEW [--fixed 5] [--dataset heldout] [--prompts 12] [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from failfast import Fixed, drafter_failfast
from failfast.bench.datasets import load_dataset
from failfast.pipeline import Pipeline


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="drafter checkpoint folder (or embedded name) to compare against")
    ap.add_argument("new", help="drafter checkpoint folder")
    ap.add_argument("--fixed", type=int, default=5, help="the fixed draft length to compare too")
    ap.add_argument("--dataset", default="heldout")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = {"ar": Pipeline.load("target")}
    for label, path in (("old", args.old), ("new", args.new)):
        methods[f"{label} FailFast"] = Pipeline.load("target", path, drafter_failfast())
        methods[f"{label} Fixed({args.fixed})"] = Pipeline.load("target", path, Fixed(args.fixed))
    prompts = load_dataset(args.dataset, args.prompts)
    times: dict[str, list[list[float]]] = {name: [] for name in methods}
    tokens = dict.fromkeys(methods, 0)
    forwards = dict.fromkeys(methods, 0)
    with torch.inference_mode():
        for pipe in methods.values():  # warm-up
            pipe.generate(prompts[0].text, 16)
        for prompt in prompts:
            for name in methods:
                times[name].append([])
            for _ in range(args.repeats):
                reference = None
                for name, pipe in methods.items():
                    start = time.perf_counter()
                    out = pipe.generate(prompt.text, args.max_new_tokens)
                    times[name][-1].append(time.perf_counter() - start)
                    reference = out.token_ids if reference is None else reference
                    if out.token_ids != reference:
                        raise SystemExit(f"{name} is not lossless on {prompt.id}")
                    tokens[name] += len(out.token_ids)
                    forwards[name] += out.stats.target_forwards
    plain = [statistics.median(t) for t in times["ar"]]
    for name in methods:
        speedups = [p / statistics.median(t) for p, t in zip(plain, times[name])]
        print(f"{name:16s} {statistics.median(speedups):.2f}x (geomean {statistics.geometric_mean(speedups):.2f}x), "
              f"{tokens[name] / forwards[name]:.2f} tokens per target forward")


if __name__ == "__main__":
    main()
