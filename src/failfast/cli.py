"""The `failfast` command: generate, train."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from failfast.errors import FailfastError, GenerationInputError
from failfast.pipeline import Pipeline
from failfast.policies import FailFast, Fixed, Policy
from failfast.verify import SamplingParams

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def _policy(args: argparse.Namespace) -> Policy | None:
    policy = args.policy or ("failfast" if args.drafter else "ar")
    if policy == "ar":
        return None
    if args.drafter is None:
        raise GenerationInputError(f"--policy {policy} needs --drafter")
    if policy == "fixed":
        return Fixed(args.k)
    return FailFast(tau=args.tau, chunk=args.chunk, max_draft=args.max_draft)


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GenerationInputError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    policy = _policy(args)
    pipe = Pipeline.load(args.target, args.drafter if policy else None, policy,
                         unmask_threshold=args.unmask_threshold, dtype=DTYPES[args.dtype], device=args.device)
    prompt = args.prompt if args.prompt is not None else _prompt_ids(args.prompt_ids)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    result = pipe.generate(prompt, args.max_new_tokens, sampling, args.stop)
    text = result.text
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": text, "stop_reason": result.stop_reason,
                          "stats": result.stats.to_dict()}))
        return 0
    s = result.stats
    print(text if text is not None else " ".join(map(str, result.token_ids)))
    print(f"\n[{s.tokens} tokens in {s.wall_s:.2f}s ({s.tokens_per_s:.1f} tok/s); {s.rounds} target rounds, "
          f"{s.tokens_per_round:.2f} tokens/round; drafted {s.drafted}, accepted {s.accepted} "
          f"({100 * s.acceptance_rate:.0f}%); drafter passes {s.drafter_forwards}; stop: {result.stop_reason}]",
          file=sys.stderr)
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from failfast.train.data import prepare_data
    from failfast.train.loop import TrainSettings
    from failfast.train.recipe import convert_to_diffusion, train_ar

    torch.set_num_threads(args.threads) if getattr(args, "threads", None) else None
    if args.stage == "data":
        manifest = prepare_data(Path(args.out), Path(args.corpus) if args.corpus else None, args.vocab_size)
        print(f"train tokens {manifest['train_tokens']}, held-out tokens {manifest['held_out_tokens']}, "
              f"vocab {manifest['vocab_size']} -> {args.out}")
        return 0
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             warmup=min(args.warmup, max(args.steps // 10, 1)), seed=args.seed,
                             save_every=args.save_every)
    if args.stage == "ar":
        report = train_ar(Path(args.data), Path(args.out), args.size, settings, resume=args.resume)
    else:
        report = convert_to_diffusion(Path(args.init), Path(args.data), Path(args.out), settings,
                                      block_size=args.block_size, sub_block_size=args.sub_block_size,
                                      resume=args.resume)
    print(f"done: {report['steps']} steps, {report['tokens_seen']} tokens, train loss "
          f"{report['final_train_loss']:.3f}, held-out loss {report['held_out_loss']:.3f} -> {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="failfast", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, exactly as the target would")
    g.add_argument("--target", required=True, help="target model folder")
    g.add_argument("--drafter", help="drafter model folder (AR or block diffusion)")
    g.add_argument("--policy", choices=["ar", "fixed", "failfast"],
                   help="draft-length policy (default: failfast with a drafter, else plain ar)")
    g.add_argument("--k", type=int, default=5, help="draft length for --policy fixed")
    g.add_argument("--tau", type=float, default=0.45, help="FailFast confidence threshold")
    g.add_argument("--chunk", type=int, default=10, help="FailFast chunk N")
    g.add_argument("--max-draft", type=int, default=60, help="FailFast maximum draft N_max")
    g.add_argument("--unmask-threshold", type=float, default=0.05)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the target's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="same seed, same tokens (with or without a drafter)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); output ends before it")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("train", help="train the embedded models (data, ar, diffusion stages)")
    t.add_argument("stage", choices=["data", "ar", "diffusion"])
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--corpus", help="[data] folder of .py files (default: this Python's stdlib)")
    t.add_argument("--vocab-size", type=int, default=8192, help="[data] BPE vocabulary size")
    t.add_argument("--data", help="[ar, diffusion] folder written by the data stage")
    t.add_argument("--size", default="target", help="[ar] target, drafter or tiny")
    t.add_argument("--init", help="[diffusion] AR model folder to convert")
    t.add_argument("--block-size", type=int, default=32)
    t.add_argument("--sub-block-size", type=int, default=8)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--threads", type=int, help="torch CPU threads")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.set_defaults(func=cmd_train)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FailfastError as exc:
        print(f"failfast: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
