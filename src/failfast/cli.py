"""The `failfast` command: generate, batch, serve, demo, bench, train."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from failfast.drafters.block_diffusion import DEFAULT_UNMASK_THRESHOLD
from failfast.drafters.factory import DENOISE_CHOICES
from failfast.drafters.lookup import LookupSettings
from failfast.embedded import DEFAULT_DRAFTER, DEFAULT_TARGET, EMBEDDED
from failfast.errors import FailfastError, GenerationInputError
from failfast.model.precision import DTYPES, resolve_dtype
from failfast.pipeline import Pipeline
from failfast.decode.gate import SpeculationGate
from failfast.decode.policies import Fixed, Policy, PolicyFactory, cost_aware, drafter_failfast
from failfast.decode.sampling import SamplingParams



INT8 = "int8"  # --drafter-dtype: int8 weights in the drafter's linear layers (model/int8.py)
# Rows per forward for `failfast batch` (README, "Batch jobs": measured on the embedded models).
BATCH_SIZE_DEFAULT = 8


def _apply_model_defaults(args: argparse.Namespace) -> None:
    """No model flags: the embedded target, with the embedded block-diffusion drafter unless
    plain AR decoding is asked for. A user's own target gets no default drafter."""
    if args.target is None:
        args.target = DEFAULT_TARGET
        if args.drafter is None and args.policy != "ar":
            args.drafter = DEFAULT_DRAFTER


def _policy(args: argparse.Namespace) -> Policy | PolicyFactory | None:
    policy = args.policy or ("failfast" if args.drafter or args.lookup else "ar")
    if policy == "ar":
        return None
    if args.drafter is None and not args.lookup:
        raise GenerationInputError(f"--policy {policy} needs --drafter or --lookup")
    if policy == "fixed":
        return Fixed(args.k)
    if policy == "cost-aware":  # costs measured on the loaded models, after the first prompt
        return cost_aware(chunk=args.chunk, max_draft=args.max_draft)
    return drafter_failfast(tau=args.tau, chunk=args.chunk, max_draft=args.max_draft)


def _lookup(args: argparse.Namespace, policy: Policy | PolicyFactory | None) -> LookupSettings | None:
    """Prompt lookup's settings when the run drafts with it: by default whenever a drafter
    drafts (README, "Prompt lookup": faster in every regime measured), or as asked."""
    wanted = args.lookup if args.lookup is not None else args.drafter is not None
    if not (wanted and policy):
        return None
    return LookupSettings(min_ngram=args.lookup_min_ngram, max_ngram=max(LookupSettings().max_ngram, args.lookup_min_ngram),
                          max_tokens=args.lookup_tokens)


def _prompt_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GenerationInputError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def _load_pipeline(args: argparse.Namespace) -> Pipeline:
    """The pipeline the generation flags describe (shared by generate and batch)."""
    _apply_model_defaults(args)
    policy = _policy(args)
    return Pipeline.load(args.target, args.drafter if policy else None, policy,
                         unmask_threshold=args.unmask_threshold, denoise=args.denoise, sub_block_size=args.sub_block,
                         full_vocab=args.full_draft_vocab,
                         gate=SpeculationGate() if args.speculation_gate and policy else None,
                         lookup=_lookup(args, policy),
                         dtype=resolve_dtype(args.dtype, args.device),
                         drafter_dtype=DTYPES.get(args.drafter_dtype), drafter_int8=_drafter_int8(args.drafter_dtype),
                         device=args.device)


def _drafter_int8(drafter_dtype: str) -> bool | None:
    """--drafter-dtype int8: int8 weights; auto: where they measured faster (None); a dtype: none."""
    return True if drafter_dtype == INT8 else None if drafter_dtype == "auto" else False


def _sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty)


def cmd_generate(args: argparse.Namespace) -> int:
    pipe = _load_pipeline(args)
    prompt = args.prompt if args.prompt is not None else _prompt_ids(args.prompt_ids)
    result = pipe.generate(prompt, args.max_new_tokens, _sampling(args), args.stop)
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


def cmd_batch(args: argparse.Namespace) -> int:
    """Exit status 1 when any input row failed (listed in the errors file), after all others ran."""
    from failfast.batch_job import RowDefaults, print_summary, run_batch

    pipe = _load_pipeline(args)
    defaults = RowDefaults(args.max_new_tokens, _sampling(args), tuple(args.stop))
    summary = run_batch(pipe, Path(args.input), Path(args.output), defaults, args.batch_size)
    print_summary(summary, Path(args.output))
    return 1 if summary.failed else 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from failfast.serve.app import ServerSettings, create_app
    except ImportError as exc:
        raise GenerationInputError(f"failfast serve needs the serve extra: pip install 'failfast[serve]' ({exc})") from None
    if args.threads:
        torch.set_num_threads(args.threads)
    if min(args.max_batch, args.max_queue) < 1 or (args.max_tokens is not None and args.max_tokens < 1):
        raise GenerationInputError("--max-batch, --max-queue and --max-tokens must be >= 1")
    pipe = _load_pipeline(args)
    name = args.served_model_name or (f"failfast-{args.target}" if args.target in EMBEDDED else Path(args.target).name)
    settings = ServerSettings(name, args.api_key or os.environ.get("FAILFAST_API_KEY") or None, args.max_batch,
                              args.max_queue, args.max_tokens)
    uvicorn.run(create_app(pipe, settings), host=args.host, port=args.port, log_level="info")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The embedded default end to end (`failfast generate` with no flags: FailFast over the
    block-diffusion drafter with prompt lookup) vs plain AR on one prompt, both live."""
    from failfast.bench.timing import interleaved_runs, median
    from failfast.decode.engine import SpeculativeEngine

    pipe = Pipeline.load(DEFAULT_TARGET, DEFAULT_DRAFTER, drafter_failfast(), lookup=LookupSettings())
    prompt = pipe.encode(args.prompt)
    plain = SpeculativeEngine(pipe.target)
    name = "FailFast + lookup"
    times, outputs = interleaved_runs({
        "plain AR": lambda: plain.generate(prompt, args.max_new_tokens),
        name: lambda: pipe.engine.generate(prompt, args.max_new_tokens),
    }, repeats=args.repeats)
    ar, ff = outputs["plain AR"], outputs[name]
    if ar.token_ids != ff.token_ids:
        raise FailfastError(f"{name} output differs from plain AR output: this is a bug, please report it")
    print(args.prompt + ff.text)
    t_ar, t_ff = median(times["plain AR"]), median(times[name])
    s = ff.stats
    print(f"\nplain AR: {ar.stats.tokens / t_ar:.1f} tok/s | {name}: {s.tokens / t_ff:.1f} tok/s | "
          f"speedup {t_ar / t_ff:.2f}x (median of {args.repeats} interleaved runs, tokens identical)\n"
          f"{name} committed {s.tokens_per_round:.2f} tokens per target forward; drafted {s.drafted}, "
          f"accepted {s.accepted}, drafter passes {s.drafter_forwards}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from failfast.bench.datasets import load_dataset
    from failfast.bench.methods import MethodFactory, default_methods
    from failfast.bench.report import write_report
    from failfast.bench.runner import BASELINE, run_bench
    from failfast.embedded import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats = args.prompts or 2, 32, 1
    specs = default_methods()
    if args.methods:
        wanted = {BASELINE, *args.methods.split(",")}
        unknown = wanted - {s.name for s in specs}
        if unknown:
            raise GenerationInputError(f"unknown methods: {', '.join(sorted(unknown))} "
                                       f"(choose from {', '.join(s.name for s in specs)})")
        specs = [s for s in specs if s.name in wanted]
    prompts = load_dataset(args.dataset, args.prompts)
    dtype = resolve_dtype(args.dtype)
    factory = MethodFactory(resolve_model(args.target), {"ar": args.ar_drafter, "dllm": args.dllm_drafter,
                                                         "dflash": args.dflash_drafter, "eagle3": args.eagle3_drafter},
                            dtype, SamplingParams(temperature=args.temperature, seed=args.seed))
    results = run_bench(factory, specs, prompts, args.max_new_tokens, args.repeats)
    meta = {"dataset": args.dataset, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats, "threads": torch.get_num_threads(), "dtype": str(dtype).removeprefix("torch."),
            "temperature": args.temperature,
            "command": "failfast bench " + " ".join(sys.argv[2:])}
    out = Path(args.out)
    write_report(results, [s.name for s in specs], meta, out, factory.target.tokenizer,
                 {p.id: p.text for p in prompts})
    print((out / "results.md").read_text())
    differing = [s.name for s in specs if s.is_peer and any(r.outputs[s.name].token_ids != r.outputs["ar"].token_ids
                                                           for r in results)]
    print("all our methods lossless" + (f" (peers with their own kernels differ: {', '.join(differing)})"
                                        if differing else "") + f"; results in {out}/")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from failfast.train.data import prepare_data
    from failfast.train.loop import TrainSettings
    from failfast.train.recipe import convert_to_diffusion, train_ar, train_causal_windows

    torch.set_num_threads(args.threads) if getattr(args, "threads", None) else None
    if args.stage == "data":
        packages = [name for name in (args.packages or "").split(",") if name]
        manifest = prepare_data(Path(args.out), Path(args.corpus) if args.corpus else None, args.vocab_size, packages,
                                Path(args.tokenizer) if args.tokenizer else None,
                                Path(args.packages_from) if args.packages_from else None)
        print(f"train tokens {manifest['train_tokens']}, held-out tokens {manifest['held_out_tokens']}, "
              f"vocab {manifest['vocab_size']} -> {args.out}")
        return 0
    if args.stage == "selfdistill":
        return _self_distill(args)
    if args.stage == "draft-vocab":
        return _draft_vocab(args)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                             warmup=min(args.warmup, max(args.steps // 10, 1)), seed=args.seed,
                             save_every=args.save_every, precision=args.precision, compile=not args.no_compile)
    resume_from = Path(args.resume_from) if args.resume_from else None
    rows = Path(args.rows) if args.rows else None
    teacher = Path(args.teacher) if args.teacher else None
    if args.stage in ("dflash", "eagle3"):
        report = _train_feature_drafter(args, settings, resume_from, rows)
    elif args.stage == "ar":
        report = train_ar(Path(args.data), Path(args.out), args.size, settings, teacher=teacher,
                          init=Path(args.init) if args.init else None, resume=args.resume or resume_from is not None,
                          resume_from=resume_from, rows=rows)
    elif args.stage == "causal-windows":
        if not args.init or teacher is not None:
            raise GenerationInputError("train causal-windows needs --init (a block-diffusion drafter or an AR model) "
                                       "and learns tokens (--rows or the corpus), not a --teacher")
        report = train_causal_windows(Path(args.init), Path(args.data), Path(args.out), settings, masks=args.window_masks,
                                      anchor_share=args.anchor_share, resume=args.resume or resume_from is not None,
                                      resume_from=resume_from, rows=rows)
    else:
        report = convert_to_diffusion(Path(args.init), Path(args.data), Path(args.out), settings,
                                      block_size=args.block_size or 32, sub_block_size=args.sub_block_size,
                                      resume=args.resume or resume_from is not None, resume_from=resume_from,
                                      teacher=teacher, suffix_mask_share=args.suffix_mask_share, rows=rows,
                                      decay_gamma=args.decay_gamma)
    print(f"done: {report['steps']} steps, {report['tokens_seen']} tokens, train loss "
          f"{report['final_train_loss']:.3f}, held-out loss {report['held_out_loss']:.3f} -> {args.out}")
    return 0


def _train_feature_drafter(args: argparse.Namespace, settings, resume_from: Path | None, rows: Path | None) -> dict:
    """The dflash and eagle3 stages: drafters that read the target's features."""
    from failfast.embedded import resolve_model
    from failfast.train.feature_drafters import DEFAULT_DECAY_GAMMA

    if not args.target or not args.data or rows is None:
        raise GenerationInputError(f"train {args.stage} needs --target, --data and --rows (the target's self-distillation rows)")
    try:
        layer_ids = tuple(int(i) for i in args.target_layers.split(",")) if args.target_layers else None
    except ValueError:
        raise GenerationInputError(f"--target-layers must be comma-separated layer indices, got {args.target_layers!r}") from None
    common = dict(target_layer_ids=layer_ids, decay_gamma=args.decay_gamma or DEFAULT_DECAY_GAMMA,
                  init=Path(args.init) if args.init else None, draft_vocab_size=args.draft_vocab_size or None,
                  soft_labels=args.soft_labels, resume=args.resume or resume_from is not None, resume_from=resume_from)
    if args.stage == "eagle3":
        from failfast.train.eagle3 import train_eagle3
        return train_eagle3(resolve_model(args.target), Path(args.data), rows, Path(args.out), settings, **common)
    from failfast.train.dflash import train_dflash
    return train_dflash(resolve_model(args.target), Path(args.data), rows, Path(args.out), settings,
                        layers=args.layers, block_size=args.block_size, **common)


def _draft_vocab(args: argparse.Namespace) -> int:
    from failfast.train.draft_vocab import write_draft_vocab

    if not args.rows:
        raise GenerationInputError("train draft-vocab needs --rows (a self-distillation folder)")
    out = write_draft_vocab(Path(args.rows), Path(args.out), args.draft_vocab_size)
    print(f"done: {out['size']} tokens covering {100 * out['coverage']:.2f}% of {out['target_tokens_counted']} "
          f"target tokens -> {args.out}/draft_vocab.json")
    return 0


def _self_distill(args: argparse.Namespace) -> int:
    from failfast.embedded import resolve_model
    from failfast.train.selfdistill import SelfDistillSettings, generate_self_distillation

    if not args.target or not args.data:
        raise GenerationInputError("train selfdistill needs --target and --data")
    settings = SelfDistillSettings(tokens=args.tokens, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                   batch_size=args.batch_size, sampled_share=args.sampled_share,
                                   temperature=args.temperature, seed=args.seed)
    manifest = generate_self_distillation(resolve_model(args.target), Path(args.data), Path(args.out), settings,
                                          resolve_dtype(args.dtype))
    rate = manifest["tokens_per_s_last_run"]
    print(f"done: {manifest['rows']} rows, {manifest['target_tokens']} target tokens"
          + (f", {rate:.0f} tok/s" if rate else "") + f" -> {args.out}")
    return 0


def _add_generation_flags(g: argparse.ArgumentParser) -> None:
    """Models, policy, drafting, sampling and precision flags of generate and batch."""
    _add_model_flags(g)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    g.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0, help="same seed, same tokens (with or without a drafter)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide positive logits (multiply negative ones) of tokens seen in the prompt or output; 1: off")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from the logit of every token the output holds")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per occurrence in the output")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable); output ends before it")


def _add_model_flags(g: argparse.ArgumentParser) -> None:
    """Models, policy, drafting and precision flags of generate, batch and serve."""
    g.add_argument("--target", help=f"target model folder or embedded name (default: {DEFAULT_TARGET})")
    g.add_argument("--drafter", help="drafter folder or embedded name, AR or block diffusion "
                                     f"(default with the embedded target: {DEFAULT_DRAFTER})")
    g.add_argument("--policy", choices=["ar", "fixed", "failfast", "cost-aware"],
                   help="draft-length policy (default: failfast with a drafter, else plain ar); "
                        "cost-aware: FailFast's chunks, stopping by costs measured on this machine")
    g.add_argument("--k", type=int, default=5, help="draft length for --policy fixed")
    g.add_argument("--tau", type=float, help="FailFast confidence threshold (default: the drafter kind's: 0.6 "
                                             "block diffusion, 0.8 DFlash, 0.8 EAGLE-3, 0.45 AR; README, "
                                             "\"Choosing the drafting defaults\")")
    g.add_argument("--chunk", type=int, help="FailFast / cost-aware chunk N (default: the drafter kind's: 4 block "
                                             "diffusion, 6 DFlash, 2 EAGLE-3, 8 AR)")
    g.add_argument("--max-draft", type=int, default=60, help="FailFast / cost-aware maximum draft N_max")
    g.add_argument("--unmask-threshold", type=float, default=DEFAULT_UNMASK_THRESHOLD,
                   help="block modes only (--denoise sliding etc.; the embedded drafter's own mode is causal): "
                        "unmask every position above this confidence per pass (0: one pass per window; the paper "
                        "uses 0.05)")
    g.add_argument("--denoise", choices=list(DENOISE_CHOICES),
                   help="mask-token drafter's pass (default: the one its config.json names, else sliding): causal "
                        "(causal windows: known tokens attend causally, a window of masks behind them), sliding (a "
                        "window of as many masks as the policy asks for at once, from the first undecoded token, "
                        "against cached K/V of what precedes it in its block), prefix (the same over aligned "
                        "sub-blocks), sub-block (Fast-dLLM v2's block cache) or full-block (exact)")
    g.add_argument("--sub-block", type=int,
                   help="block modes only: a fixed sliding window of S tokens, or with another --denoise the "
                        "sub-block size (default: the policy's request; the drafter's config)")
    g.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="prompt lookup: a round drafts a copy of what followed the last tokens' earlier "
                        "occurrence; rounds with nothing to copy use the drafter. On by default in front of a "
                        "drafter (--no-lookup: the drafter alone); without a drafter, --lookup is prompt lookup "
                        "alone (README, \"Prompt lookup\")")
    g.add_argument("--lookup-tokens", type=int, default=LookupSettings().max_tokens,
                   help="most tokens copied per round by prompt lookup")
    g.add_argument("--lookup-min-ngram", type=int, default=LookupSettings().min_ngram,
                   help="shortest match (in tokens) that prompt lookup copies after; 2 leaves more rounds to the drafter")
    g.add_argument("--full-draft-vocab", action="store_true",
                   help="ignore the drafter's draft_vocab.json (its output head over every token)")
    g.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="auto: bfloat16 on CUDA and on AVX512-BF16 CPUs without AMX, float32 elsewhere (README, \"Precision\")")
    g.add_argument("--drafter-dtype", choices=["auto", *sorted(DTYPES), INT8], default="auto",
                   help="the drafter's dtype (int8: int8 weights in the drafter's linear layers, activations in "
                        "--dtype's, CPU; auto: --dtype's, with int8 weights where they measured faster: a bfloat16 "
                        "AR drafter on a CPU); drafts only, so never changes the output")
    g.add_argument("--device", default="cpu")


def _add_gate_flag(g: argparse.ArgumentParser, default: bool) -> None:
    g.add_argument("--speculation-gate", action=argparse.BooleanOptionalAction, default=default,
                   help="measure plain and speculative rounds per batch size and run the faster kind "
                        f"(never changes the output; default: {'on' if default else 'off'} here)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="failfast", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete a prompt, exactly as the target would")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the target's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    _add_generation_flags(g)
    _add_gate_flag(g, default=False)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)

    bt = sub.add_parser("batch", help="complete every prompt of a JSONL file; rerun to resume")
    bt.add_argument("--input", required=True, help='JSONL, one object per line: "prompt" (text) or "prompt_ids", '
                    'optional "id" (default: line number), "max_new_tokens", "temperature", "top_k", "top_p", '
                    '"seed", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop"')
    bt.add_argument("--output", required=True, help="results JSONL (appended to; ids already there are skipped); "
                    "bad rows go to <output>.errors.jsonl")
    bt.add_argument("--batch-size", type=int, default=BATCH_SIZE_DEFAULT,
                    help="rows decoded together, one target forward per round for all of them")
    _add_generation_flags(bt)
    _add_gate_flag(bt, default=True)
    bt.set_defaults(func=cmd_batch)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)")
    _add_model_flags(sv)
    _add_gate_flag(sv, default=True)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", help="require Authorization: Bearer KEY on /v1 (default: $FAILFAST_API_KEY if set)")
    sv.add_argument("--served-model-name", help="the model id clients send (default: the target folder's name)")
    sv.add_argument("--max-batch", type=int, default=BATCH_SIZE_DEFAULT, help="requests decoded together")
    sv.add_argument("--max-queue", type=int, default=64, help="waiting requests beyond which new ones get 429")
    sv.add_argument("--max-tokens", type=int, help="most new tokens one request may ask for (default: the context)")
    sv.add_argument("--threads", type=int, help="torch CPU threads")
    sv.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="embedded models: complete a prompt, print the default pipeline's speedup over plain AR")
    # ends at the docstring, not after its newline: the tokenizer merges a newline with the next
    # line's indentation, so a prompt ending in a bare newline asks for a top-level line next
    d.add_argument("--prompt", default="def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"")
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--repeats", type=int, default=3)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="every method side by side: speed, acceptance, losslessness")
    b.add_argument("--dataset", default="humaneval", help="humaneval, heldout, or a JSONL file of prompts")
    b.add_argument("--prompts", type=int, help="number of prompts (default: all)")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--repeats", type=int, default=3, help="timed repeats per prompt (median)")
    b.add_argument("--methods", help="comma-separated subset (plain AR 'ar' is always included)")
    b.add_argument("--out", default="bench-out", help="output folder")
    b.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 32 new tokens, 1 repeat")
    b.add_argument("--target", default=DEFAULT_TARGET)
    b.add_argument("--ar-drafter", default="ar-drafter")
    b.add_argument("--dllm-drafter", default=DEFAULT_DRAFTER)
    b.add_argument("--dflash-drafter", default="dflash-drafter", help="DFlash drafter of the dflash methods")
    b.add_argument("--eagle3-drafter", default="eagle3-drafter", help="EAGLE-3 drafter of the eagle3 methods")
    b.add_argument("--threads", type=int, help="torch CPU threads")
    b.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="auto as for generate; float64 makes the token-identity check immune to rounding near-ties")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy); every method of ours must still give plain AR's "
                        "tokens, seeded (peers run greedy only)")
    b.add_argument("--seed", type=int, default=0, help="sampling seed with --temperature")
    b.set_defaults(func=cmd_bench)

    t = sub.add_parser("train", help="train the embedded models (data, ar, diffusion, causal-windows, dflash, eagle3 "
                                     "stages)")
    t.add_argument("stage", choices=["data", "ar", "diffusion", "causal-windows", "dflash", "eagle3", "selfdistill",
                                     "draft-vocab"])
    t.add_argument("--out", required=True, help="output folder")
    t.add_argument("--corpus", help="[data] folder of .py files (default: this Python's stdlib)")
    t.add_argument("--vocab-size", type=int, default=8192, help="[data] BPE vocabulary size")
    t.add_argument("--packages", help="[data] comma-separated installed packages whose .py files join the corpus "
                   "(held out by file as the stdlib is)")
    t.add_argument("--packages-from", help="[data] folder the packages are read from (a `pip install --target` "
                   "folder pinning their versions; default: this Python's installed packages)")
    t.add_argument("--tokenizer", help="[data] tokenizer.json to use instead of training one (keep a model's vocabulary)")
    t.add_argument("--draft-vocab-size", type=int, default=2048,
                   help="[draft-vocab] tokens to keep (the target's most frequent) for the drafter folder --out; "
                   "[dflash, eagle3] the draft vocabulary it trains its head on and drafts from (0: every token)")
    t.add_argument("--data", help="[ar, diffusion, causal-windows, dflash, eagle3] folder written by the data stage")
    t.add_argument("--size", default="target", help="[ar] target, drafter or tiny")
    t.add_argument("--init", help="[diffusion] AR model folder to convert; [causal-windows] a block-diffusion drafter "
                                   "or AR model to continue; [ar] checkpoint to continue "
                                   "from instead of a fresh --size model (e.g. to distil a pretrained drafter); [dflash, eagle3] a "
                                   "drafter of that kind to continue (its layers, target layers and block size)")
    t.add_argument("--teacher", help="[ar, diffusion] model folder to distil from (e.g. the trained target)")
    t.add_argument("--rows", help="[ar, diffusion, causal-windows, dflash, eagle3] train on the target's self-distillation rows in this folder "
                   "(written by the selfdistill stage) instead of the corpus")
    t.add_argument("--target", help="[selfdistill] the target model whose continuations become training data; "
                                    "[dflash, eagle3] the target whose features the drafter reads")
    t.add_argument("--layers", type=int, default=2, help="[dflash] drafter decoder layers")
    t.add_argument("--target-layers", help="[dflash, eagle3] comma-separated target layers to read (default: low, middle, last)")
    t.add_argument("--tokens", type=int, default=10_000_000, help="[selfdistill] target tokens to generate")
    t.add_argument("--prompt-len", type=int, default=64, help="[selfdistill] corpus tokens before each continuation")
    t.add_argument("--new-tokens", type=int, default=192, help="[selfdistill] target tokens per row")
    t.add_argument("--sampled-share", type=float, default=0.25,
                   help="[selfdistill] share of rows sampled at --temperature instead of greedy")
    t.add_argument("--temperature", type=float, default=0.8, help="[selfdistill] sampling temperature")
    t.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto", help="[selfdistill] inference dtype")
    t.add_argument("--decay-gamma", type=float,
                   help="[diffusion, dflash, eagle3] weight the k-th masked token of a block (eagle3: the k-th "
                        "token of a chain) by exp(-(k-1)/gamma) (dflash and eagle3 default 7)")
    t.add_argument("--soft-labels", action="store_true",
                   help="[dflash, eagle3] learn the target's next-token distributions (computed in the same "
                        "target forward as its features) instead of the rows' tokens")
    t.add_argument("--block-size", type=int, help="diffusion default 32, dflash 16")
    t.add_argument("--sub-block-size", type=int, default=8)
    t.add_argument("--suffix-mask-share", type=float, default=0.0,
                   help="[diffusion] share of blocks masked from a random cut to the block's end (the "
                        "drafting pattern) instead of uniformly")
    t.add_argument("--window-masks", type=int, default=3,
                   help="[causal-windows] masks in each training window (a window drafts one token more)")
    t.add_argument("--anchor-share", type=int, default=4,
                   help="[causal-windows] a window behind every N-th position of a training row, on average")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--seq-len", type=int, default=256)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--threads", type=int, help="torch CPU threads")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    t.add_argument("--resume-from", help="continue from this folder when OUT/checkpoint is missing: 16-bit "
                   "weights + state.json saved by a session (new optimizer moments, short re-warm-up)")
    t.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 autocast where bf16 is native (AVX512-BF16, AMX, CUDA), else fp32")
    t.add_argument("--no-compile", action="store_true", help="skip torch.compile (faster start, slower steps)")
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
