"""Interleaved A/B of two checkpoints of one drafter: does a training pass pay?

Runs plain AR and, for each checkpoint, FailFast over it (the drafter kind's defaults) and
one fixed draft length through the benchmark's runner (interleaved per prompt, warmed up,
every method checked token-identical to plain AR), then prints each method's median (and
geometric-mean) speedup over plain AR, its tokens per target forward and its acceptance at
draft positions 1-4.

    python scripts/drafter_ab.py OLD NEW [--fixed 5] [--dataset heldout] [--prompts 12] [--repeats 2]
                                         [--temperature 0.8 --seed 1]

With a temperature every method samples (seeded, so each reproduces plain sampling token for
token) and the drafters draft with the verifier's noise (coupled drafting).
"""

from __future__ import annotations

import argparse

import torch

from failfast import Fixed, drafter_failfast
from failfast.bench.datasets import load_dataset
from failfast.bench.methods import MethodFactory, MethodSpec
from failfast.bench.report import summarize
from failfast.bench.runner import BASELINE, run_bench
from failfast.decode.sampling import SamplingParams
from failfast.embedded import resolve_model
from failfast.model.precision import default_dtype


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
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--seed", type=int, default=1, help="sampling seed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    factory = MethodFactory(resolve_model("target"), {"old": args.old, "new": args.new}, default_dtype("cpu"),
                            sampling=sampling)
    specs = [MethodSpec(BASELINE, "ar")]
    for which in ("old", "new"):
        specs += [MethodSpec(f"{which} FailFast", f"{which}-drafter", drafter_failfast()),
                  MethodSpec(f"{which} Fixed({args.fixed})", f"{which}-drafter", Fixed(args.fixed))]
    results = run_bench(factory, specs, load_dataset(args.dataset, args.prompts), args.max_new_tokens, args.repeats)
    for row in summarize(results, [s.name for s in specs]):
        accepted = row.get("acceptance_by_position") or []
        by_position = " / ".join("n/a" if a is None else f"{a:.2f}" for a in accepted[:4])
        print(f"{row['name']:16s} {row['speedup_median']:.2f}x (geomean {row['speedup_geomean']:.2f}x), "
              f"{row['tokens_per_target_forward']:.2f} tokens per target forward"
              + (f", acceptance at positions 1-4 {by_position}" if by_position else ""))


if __name__ == "__main__":
    main()
