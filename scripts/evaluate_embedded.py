"""Held-out quality of the embedded models (numbers for the model cards).

- target held-out loss (nats/token) on the held-out stdlib files;
- greedy FailFast on held-out stdlib functions: tokens committed per target forward;
- whether the target's own greedy output is degenerate: share of repeated 4-grams, next to
  the same share in real held-out code windows of the same length (code repeats itself too).

    python scripts/evaluate_embedded.py [--models DIR] [--functions 40] [--max-new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from failfast import SpeculativeEngine, drafter_failfast, load_model, make_drafter
from failfast.bench.datasets import heldout_functions
from failfast.embedded import MODELS_DIR
from failfast.train.corpus import stdlib_root


def held_out_stream(target, manifest: dict) -> list[int]:
    eos = target.config.eos_token_ids[0]
    ids: list[int] = []
    for rel in manifest["held_out_files"]:
        path = stdlib_root() / rel
        if path.is_file():
            ids += target.tokenizer.encode(path.read_text(encoding="utf-8", errors="replace")) + [eos]
    return ids


def held_out_loss(target, ids: list[int], window: int = 256, max_windows: int = 200) -> float:
    stream = torch.tensor(ids)
    n = min((stream.numel() - 1) // window, max_windows)
    total = 0.0
    with torch.inference_mode():
        for i in range(n):
            chunk = stream[i * window:(i + 1) * window + 1]
            cache = target.model.new_cache(window)
            logits = target.model(chunk[None, :-1], 0, cache)[0]
            total += float(F.cross_entropy(logits.float(), chunk[1:]))
    return total / n


def repeated_4gram_share(tokens: list[int]) -> float:
    grams = [tuple(tokens[i:i + 4]) for i in range(len(tokens) - 3)]
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams) if grams else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=MODELS_DIR, help="folder with target/ and dllm-drafter/")
    parser.add_argument("--manifest", type=Path, help="corpus manifest (default: MODELS/corpus.json)")
    parser.add_argument("--functions", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    manifest_path = args.manifest or args.models / "corpus.json"
    manifest = json.loads(manifest_path.read_text())
    target = load_model(args.models / "target")
    drafter = make_drafter(target, load_model(args.models / "dllm-drafter"))
    plain, failfast = SpeculativeEngine(target), SpeculativeEngine(target, drafter, drafter_failfast())
    prompts = heldout_functions(args.functions, manifest_path)
    tokens = rounds = 0
    repeat_shares = []
    for p in prompts:
        ids = target.tokenizer.encode(p.text)
        ref = plain.generate(ids, args.max_new_tokens)
        got = failfast.generate(ids, args.max_new_tokens)
        assert got.token_ids == ref.token_ids, f"FailFast output differs from plain AR on {p.id}"
        tokens += got.stats.tokens
        rounds += got.stats.rounds
        repeat_shares.append(repeated_4gram_share(ref.token_ids))
    stream = held_out_stream(target, manifest)
    windows = [stream[i:i + args.max_new_tokens] for i in range(0, len(stream) - args.max_new_tokens,
                                                                     args.max_new_tokens)]
    result = {
        "target_held_out_loss": held_out_loss(target, stream),
        "functions": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "failfast_tokens_per_target_forward": tokens / rounds,
        "target_repeated_4gram_share": sum(repeat_shares) / len(repeat_shares),
        "held_out_code_repeated_4gram_share": sum(map(repeated_4gram_share, windows)) / len(windows),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
