"""Speed of this working tree against an earlier revision: `failfast bench` run from each
tree in turn, alternating, and the median tokens/s of every method per tree.

A VM's speed drifts by 10-30% over minutes, so one bench per tree says little; alternating
short runs (which tree goes first alternates too) and taking medians does. Each tree is a
separate process with its own code and embedded models (the base revision is unpacked from
git into a temporary folder).

    python scripts/revision_ab.py [--base HEAD~1] [--methods failfast,eagle3] [--rounds 3] [--keep DIR] [-- bench flags]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def unpack(revision: str, into: Path) -> Path:
    """The tree of `revision` (tracked files only) under `into`."""
    archive = into / "tree.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive), revision], check=True)
    with tarfile.open(archive) as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
            tar.extractall(into / "tree", filter="data")
        else:
            tar.extractall(into / "tree")
    archive.unlink()
    return into / "tree"


def bench(tree: Path, out: Path, flags: list[str]) -> dict[str, float]:
    """Median tokens/s of every method of one `failfast bench` run from `tree`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree / "src"), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-m", "failfast.cli", "bench", "--out", str(out), *flags], check=True, env=env,
                   cwd=tree, stdout=subprocess.DEVNULL)
    methods = json.loads((out / "results.json").read_text())["methods"]
    return {m["name"]: m["tokens_per_s_median"] for m in methods}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="HEAD~1", help="git revision to compare with (default: HEAD~1)")
    ap.add_argument("--methods", default="failfast,failfast-eagle3,eagle3,failfast-dflash")
    ap.add_argument("--rounds", type=int, default=3, help="bench runs per tree, alternating")
    ap.add_argument("--keep", type=Path, help="folder to keep every run's bench output in (default: discarded)")
    ap.add_argument("bench_flags", nargs="*", help="after --: more `failfast bench` flags "
                    "(default: --dataset heldout --prompts 8 --max-new-tokens 128 --repeats 1 --threads 2)")
    args = ap.parse_args()
    flags = args.bench_flags or "--dataset heldout --prompts 8 --max-new-tokens 128 --repeats 1 --threads 2".split()
    flags = [*flags, "--methods", args.methods]
    with tempfile.TemporaryDirectory() as tmp:
        outputs = args.keep.resolve() if args.keep else Path(tmp)  # each bench runs in its own tree
        trees = {args.base: unpack(args.base, Path(tmp)), "working tree": ROOT}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                out = outputs / f"{name.replace(' ', '-').replace('/', '-')}-{len(runs[name])}"
                runs[name].append(bench(trees[name], out, flags))
                print(f"round {r + 1}/{args.rounds} {name}: " + ", ".join(f"{m} {v:.1f}" for m, v in runs[name][-1].items()),
                      flush=True)
    print(f"\n| method | {args.base} tok/s | working tree tok/s | ratio |\n|---|---|---|---|")
    for method in dict.fromkeys(m for name in trees for run in runs[name] for m in run):
        old_tps, new_tps = (median_of(runs[name], method) for name in trees)
        print(f"| {method} | {old_tps:.1f} | {new_tps:.1f} | {new_tps / old_tps:.2f}x |")


def median_of(runs: list[dict[str, float]], method: str) -> float:
    """Median tokens/s of a method over the runs that have it (NaN if none)."""
    values = [run[method] for run in runs if method in run]
    return statistics.median(values) if values else float("nan")


if __name__ == "__main__":
    main()
