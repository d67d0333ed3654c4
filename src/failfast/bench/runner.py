"""Run every method on every prompt, interleaved, and check each against plain AR."""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from failfast.bench.datasets import Prompt
from failfast.bench.methods import MethodFactory, MethodOutput, MethodSpec
from failfast.bench.timing import interleaved_runs
from failfast.errors import FailfastError
from failfast.progress import log_milestone

BASELINE = "ar"


class LosslessError(FailfastError):
    """A method produced tokens different from plain AR decoding."""


@dataclass
class PromptResult:
    prompt_id: str
    prompt_tokens: int
    times: dict[str, list[float]]
    outputs: dict[str, MethodOutput]


def check_lossless(prompt_id: str, outputs: dict[str, MethodOutput], peers: frozenset[str] = frozenset()) -> None:
    """Every method of ours must give plain AR's tokens; peers (other engines) are only reported."""
    reference = outputs[BASELINE].token_ids
    for name, out in outputs.items():
        if out.token_ids != reference and name not in peers:
            at = next((i for i, (a, b) in enumerate(zip(out.token_ids, reference)) if a != b),
                      min(len(out.token_ids), len(reference)))
            raise LosslessError(f"method {name!r} is not lossless on prompt {prompt_id}: its tokens differ from "
                                f"plain AR from generated position {at} on")


def run_bench(factory: MethodFactory, specs: list[MethodSpec], prompts: list[Prompt], max_new_tokens: int,
              repeats: int, warmup: int = 1) -> list[PromptResult]:
    """Per prompt: all methods interleaved `repeats` times; warm-up on the first prompt."""
    if BASELINE not in [s.name for s in specs]:
        raise FailfastError(f"the method list must include the baseline {BASELINE!r}")
    runners = {s.name: factory.runner(s) for s in specs}
    peers = frozenset(s.name for s in specs if s.is_peer)
    tokenizer = factory.target.tokenizer
    results = []
    columns = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[prompt]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    started = time.perf_counter()
    with Progress(*columns) as bar:
        task = bar.add_task("bench", total=len(prompts), prompt="")
        for i, prompt in enumerate(prompts):
            bar.update(task, prompt=prompt.id)
            ids = tokenizer.encode(prompt.text)
            reference = runners[BASELINE](ids, max_new_tokens, []).token_ids
            methods = {name: partial(run, ids, max_new_tokens, reference) for name, run in runners.items()}
            times, outputs = interleaved_runs(methods, repeats, warmup if i == 0 else 0, rotation=i * repeats)
            check_lossless(prompt.id, outputs, peers)
            results.append(PromptResult(prompt.id, len(ids), times, outputs))
            bar.advance(task)
            log_milestone(bar, i + 1, len(prompts), started, f"prompts benchmarked (last: {prompt.id})")
    return results
