"""Throughput of the batch regime: plain AR, the AR drafter (Fixed 4), FailFast, FailFast
over the DFlash and EAGLE-3 drafters, prompt lookup alone (Fixed 8) and in front of the
block-diffusion and EAGLE-3 drafters at several batch sizes, same prompts; `--gated` adds each
speculative method behind a speculation gate ("+gate": rounds skip drafting where plain rounds
measure faster, decode/gate.py); `--bucketed` adds each method with verification forwards
padded to a few shapes ("+buckets", what a GPU capturing its forwards needs; its cost on
this machine); `--vllm` adds vLLM on the same weights (plain, ngram, our AR
drafter as its draft model, our FailFast proposer with and without its gate, and gated with prompt
lookup; needs the vllm extra). vLLM gets the
prompts in chunks of B (static batches; its engines hold up to the largest B), ours refill
freed rows (continuous batching); with a fixed number of new tokens rows end together anyway.

Every (method, batch size) runs once per repeat, interleaved, after a warm-up; the table gives
median tokens/s and each row's ratio to plain AR at the same batch size. Rows whose tokens
differ from the B = 1 run of the same method are counted (batched float32 forwards may round
a near-tie differently from one-row forwards; float64 never does, see the tests).

    python scripts/batch_throughput.py --prompts 64 --max-new-tokens 64 --batch-sizes 1,4,16,64 --gated
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from failfast import Fixed, LookupDrafter, LookupSettings, Pipeline, SpeculationGate, failfast_for, load_model, make_drafter
from failfast.bench.datasets import load_dataset
from failfast.embedded import resolve_model
from failfast.decode.engine import GenerationRequest, SpeculativeEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,4,16,32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int)
    p.add_argument("--methods", help="comma-separated subset of the method names (default: all)")
    p.add_argument("--gated", action="store_true", help="add every speculative method behind a speculation gate")
    p.add_argument("--bucketed", action="store_true", help="add every method with bucketed (padded) verification shapes")
    p.add_argument("--vllm", action="store_true", help="add vLLM peers (vllm-ar, vllm-ngram, vllm-draft-model, "
                                                      "vllm-failfast, vllm-failfast-ungated, vllm-failfast-lookup)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    pipe = Pipeline.load("target")
    dtype = pipe.target.model.dtype  # every drafter in the target's dtype, as `failfast generate` runs them
    ar_drafter, dllm, dflash, eagle3 = (make_drafter(pipe.target, load_model(resolve_model(name), dtype=dtype))
                                        for name in ("ar-drafter", "dllm-drafter", "dflash-drafter", "eagle3-drafter"))
    # FailFast with each drafter kind's defaults, as policies (not factories) that the gated
    # and bucketed copies below can share
    engines = {"ar": pipe.engine, "ar-fixed-4": SpeculativeEngine(pipe.target, ar_drafter, Fixed(4)),
               "failfast": SpeculativeEngine(pipe.target, dllm, failfast_for(dllm)),
               "failfast-dflash": SpeculativeEngine(pipe.target, dflash, failfast_for(dflash)),
               "failfast-eagle3": SpeculativeEngine(pipe.target, eagle3, failfast_for(eagle3)),
               "lookup": SpeculativeEngine(pipe.target, LookupDrafter(None), Fixed(LookupSettings().max_tokens))}
    engines |= {f"{name}-lookup": SpeculativeEngine(pipe.target, LookupDrafter(engines[name].drafter),
                                                    engines[name].policy) for name in ("failfast", "failfast-eagle3")}
    if args.gated:  # a fresh gate per method: it learns that method's rates
        engines |= {f"{name}+gate": SpeculativeEngine(e.target, e.drafter, e.policy, SpeculationGate())
                    for name, e in engines.items() if e.drafter is not None}
    if args.bucketed:
        engines |= {f"{name}+buckets": SpeculativeEngine(e.target, e.drafter, e.policy, bucketed_shapes=True)
                    for name, e in list(engines.items()) if e.gate is None}
    requests = [GenerationRequest(pipe.encode(x.text), args.max_new_tokens) for x in load_dataset(args.dataset, args.prompts)]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    methods: dict[str, Callable[[int], tuple[list[list[int]], int]]] = {name: _ours(e, requests)
                                                                         for name, e in engines.items()}
    if args.vllm:
        methods |= _vllm_peers(dtype, [r.prompt_ids for r in requests], args.max_new_tokens, max(sizes))
    if args.methods:
        methods = {name: methods[name] for name in dict.fromkeys(["ar", *args.methods.split(",")])}
    runs = [(m, b) for b in sizes for m in methods]
    times: dict[tuple[str, int], list[float]] = {r: [] for r in runs}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    tokens: dict[tuple[str, int], int] = {}
    forwards: dict[tuple[str, int], int] = {}  # decoding forwards of the target (prefill not counted)
    for repeat in range(args.repeats + 1):  # the first pass warms up and is not timed
        for method, b in runs:
            t0 = time.perf_counter()
            outputs[(method, b)], forwards[(method, b)] = methods[method](b)
            elapsed = time.perf_counter() - t0
            tokens[(method, b)] = sum(len(t) for t in outputs[(method, b)])
            if repeat:
                times[(method, b)].append(elapsed)
            print(f"repeat {repeat} {method} B={b}: {tokens[(method, b)] / elapsed:.1f} tok/s", flush=True)
    print(f"\n{len(requests)} {args.dataset} prompts, {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}\n")
    print("| method | B | tokens/s | vs plain AR at this B | vs plain AR at B=1 | tokens / target fwd per row | "
          "rows differing from B=1 | rows differing from our plain AR |")
    print("|---|---|---|---|---|---|---|---|")
    rate = {r: tokens[r] / statistics.median(times[r]) for r in runs}
    for method, b in runs:
        differing = sum(x != y for x, y in zip(outputs[(method, b)], outputs[(method, sizes[0])]))
        from_ar = sum(x != y for x, y in zip(outputs[(method, b)], outputs[("ar", b)]))
        print(f"| {method} | {b} | {rate[(method, b)]:.1f} | {rate[(method, b)] / rate[('ar', b)]:.2f}x | "
              f"{rate[(method, b)] / rate[('ar', sizes[0])]:.2f}x | {f'{tokens[(method, b)] / forwards[(method, b)]:.2f}' if forwards[(method, b)] else 'n/a'} | "
              f"{differing} | {from_ar} |")


def _ours(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> Callable[[int], tuple[list[list[int]], int]]:
    """Our engine at batch size B (B rows decode together, freed rows take the next request):
    each row's tokens and the rows' verification rounds."""
    def run(b: int) -> tuple[list[list[int]], int]:
        done = dict(engine.generate_many(requests, b))
        return [done[i].token_ids for i in range(len(requests))], sum(r.stats.rounds for r in done.values())
    return run


def _vllm_peers(dtype: torch.dtype, prompts: list[list[int]], max_new: int,
                max_batch: int) -> dict[str, Callable[[int], tuple[list[list[int]], int]]]:
    """vLLM engines on the embedded target: B prompts per `generate` call; target forwards
    per row from vLLM's per-request acceptance counts."""
    from failfast.embedded import DEFAULT_DRAFTER
    from failfast.integrations.vllm_peers import VLLM_METHODS, VllmGenerator, proposer_config, speculative_config
    peers = {}
    for name in VLLM_METHODS:
        generator = VllmGenerator(resolve_model("target"), dtype, speculative_config(name, resolve_model("ar-drafter")),
                                  proposer_config(name, DEFAULT_DRAFTER, dtype), max_num_seqs=max_batch)
        peers[name] = _chunked(generator, prompts, max_new)
    return peers


def _chunked(generator, prompts: list[list[int]], max_new: int) -> Callable[[int], tuple[list[list[int]], int]]:
    def run(b: int) -> tuple[list[list[int]], int]:
        done = [c for i in range(0, len(prompts), b) for c in generator.generate(prompts[i:i + b], max_new)]
        return [c.token_ids for c in done], sum(c.stats.rounds for c in done)
    return run


if __name__ == "__main__":
    main()
