"""The benchmark: refuses non-lossless methods; the quick run writes every report."""

from __future__ import annotations

import json

import pytest

from failfast.bench.datasets import Prompt, jsonl_prompts, load_dataset
from failfast.bench.methods import MethodFactory, MethodOutput, MethodSpec, default_methods
from failfast.bench.runner import LosslessError, run_bench
from failfast.cli import main
from failfast.decode.policies import FailFast, Fixed
from failfast.decode.sampling import SamplingParams
from failfast.drafters.lookup import LookupSettings
from failfast.errors import FailfastError, GenerationInputError
from tests.helpers import copy_checkpoint, write_word_tokenizer


class CorruptingFactory(MethodFactory):
    """Breaks one method on purpose: it changes the last generated token."""

    def runner(self, spec):
        run = super().runner(spec)
        if spec.name != "broken":
            return run

        def broken(prompt, max_new, reference):
            out = run(prompt, max_new, reference)
            return MethodOutput(out.token_ids[:-1] + [(out.token_ids[-1] + 1) % 90], out.stats)
        return broken


@pytest.fixture
def word_models(random_models, tmp_path):
    folders = {}
    for name in ("target", "random-ar", "random-dllm"):
        folders[name] = copy_checkpoint(random_models[name], tmp_path / name)
        write_word_tokenizer(folders[name], 96)
    return folders


def test_a_method_with_different_tokens_fails_the_bench(word_models):
    factory = CorruptingFactory(word_models["target"], {"ar": word_models["random-ar"], "dllm": word_models["random-dllm"]})
    specs = [MethodSpec("ar", "ar"), MethodSpec("dllm-fixed-3", "dllm-drafter", Fixed(3)),
             MethodSpec("broken", "dllm-drafter", Fixed(3))]
    prompts = [Prompt("p0", "<5> <6> <7>")]
    with pytest.raises(LosslessError, match="'broken' is not lossless on prompt p0"):
        run_bench(factory, specs, prompts, max_new_tokens=12, repeats=1)
    peer = [MethodSpec("broken", "hf")]  # a peer engine that differs is reported, not an error
    results = run_bench(factory, specs[:2] + peer, prompts, max_new_tokens=12, repeats=1)
    assert results[0].outputs["broken"].token_ids != results[0].outputs["ar"].token_ids
    assert results[0].outputs["dllm-fixed-3"].token_ids == results[0].outputs["ar"].token_ids


def test_a_sampled_bench_checks_every_method_against_sampled_plain_ar(word_models):
    """Seeded sampling is reproduced token for token, so the identity check holds at a
    temperature too (and still catches a broken method); peers decode greedily, without penalties."""
    paths = {"ar": word_models["random-ar"], "dllm": word_models["random-dllm"]}
    sampled = CorruptingFactory(word_models["target"], paths, sampling=SamplingParams(temperature=1.0, seed=3))
    specs = [MethodSpec("ar", "ar"), MethodSpec("dllm-fixed-3", "dllm-drafter", Fixed(3)),
             MethodSpec("lookup-ff", "dllm-drafter", FailFast(tau=0.0, chunk=3), lookup=LookupSettings())]
    prompts = [Prompt("p0", "<5> <6> <7> <5> <6>")]
    results = run_bench(sampled, specs, prompts, max_new_tokens=16, repeats=1)
    greedy = run_bench(MethodFactory(word_models["target"], paths), specs[:1], prompts, max_new_tokens=16, repeats=1)
    assert results[0].outputs["ar"].token_ids != greedy[0].outputs["ar"].token_ids
    with pytest.raises(LosslessError, match="'broken'"):
        run_bench(sampled, specs[:1] + [MethodSpec("broken", "dllm-drafter", Fixed(3))], prompts, 16, 1)
    with pytest.raises(GenerationInputError, match="greedily without penalties only"):
        sampled.runner(MethodSpec("hf", "hf"))
    penalized = MethodFactory(word_models["target"], paths, sampling=SamplingParams(repetition_penalty=1.2))
    with pytest.raises(GenerationInputError, match="greedily without penalties only"):
        penalized.runner(MethodSpec("hf", "hf"))


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "prompt": "def f():"}\n\n{"prompt": "x = 1"}\n')
    assert jsonl_prompts(path) == [Prompt("a", "def f():"), Prompt("2", "x = 1")]
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(FailfastError, match='"prompt"'):
        jsonl_prompts(path)
    with pytest.raises(FailfastError, match="unknown dataset"):
        load_dataset("no-such-dataset")


def test_datasets_have_prompts():
    humaneval = load_dataset("humaneval")
    assert len(humaneval) == 164 and humaneval[0].text.startswith("from typing import List")
    heldout = load_dataset("heldout", 20)
    assert len(heldout) == 20 and all(p.text.lstrip().startswith(("def ", "async def ")) for p in heldout)


def test_quick_bench_on_embedded_models(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    assert "2/2 prompts benchmarked" in capsys.readouterr().out  # progress lines in a log
    report = json.loads((out / "results.json").read_text())
    names = [m["name"] for m in report["methods"]]
    assert names == [s.name for s in default_methods()]
    peers = {s.name for s in default_methods() if s.is_peer}
    for m in report["methods"]:  # peers (transformers) run their own kernels: a near-tie may round otherwise
        assert m["speedup_median"] > 0
        assert m["lossless"] is True or m["name"] in peers
    table = (out / "results.md").read_text()
    assert "| failfast |" in table and "Acceptance by draft position" in table
    by_name = {m["name"]: m for m in report["methods"]}
    assert "acceptance_by_position" not in by_name["ar"]
    shares = by_name["failfast"]["acceptance_by_position"]
    assert len(shares) == 8 and shares[0] is not None and all(v is None or 0 <= v <= 1 for v in shares)
    for png in ("speedup.png", "accepted_cdf.png", "acceptance_rounds.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "trajectory.html").read_text()
    assert page.count("<tr>") >= 2 and 'class="acc"' in page


def test_summary_reports_forwards_without_timings_for_engines_that_hide_them():
    """A peer engine (vLLM) reports tokens, target forwards and acceptance but no internal
    timings: the summary has its tokens per forward and leaves the timing columns out."""
    from failfast.bench.report import summarize
    from failfast.bench.runner import BASELINE, PromptResult
    from failfast.decode.stats import GenerationStats

    ours = GenerationStats(tokens=8, rounds=8, target_forwards=8, wall_s=0.1, draft_s=0.0, verify_s=0.08)
    peer = GenerationStats(tokens=8, rounds=3, drafted=9, accepted=5, target_forwards=3)
    tokens = list(range(8))
    result = PromptResult("p", 4, {BASELINE: [0.1], "peer": [0.05]},
                          {BASELINE: MethodOutput(tokens, ours), "peer": MethodOutput(tokens, peer)})
    base, other = summarize([result], [BASELINE, "peer"])
    assert base["drafter_forwards_per_round"] == 0 and base["tokens_per_target_forward"] == 1
    assert other["tokens_per_target_forward"] == pytest.approx(8 / 3)
    assert other["acceptance_rate"] == pytest.approx(5 / 9)
    assert "drafter_forwards_per_round" not in other and "draft_time_share" not in other
    assert "acceptance_by_position" not in base and "acceptance_by_position" not in other  # no drafts / no rounds


def test_acceptance_by_position_conditions_on_the_earlier_tokens():
    """Position i counts the rounds that verified draft token i with tokens 0..i-1 accepted;
    a round stops counting after its first rejection, and a verified prefix shorter than i never counts."""
    from failfast.decode.stats import RoundStats, acceptance_by_position

    rounds = [RoundStats(drafted=4, accepted=4, drafter_forwards=1, confidences=[]),   # 4 of 4
              RoundStats(drafted=4, accepted=1, drafter_forwards=1, confidences=[]),   # 0 yes, 1 no
              RoundStats(drafted=2, accepted=0, drafter_forwards=1, confidences=[]),   # 0 no
              RoundStats(drafted=0, accepted=0, drafter_forwards=0, confidences=[])]   # nothing verified
    assert acceptance_by_position(rounds, positions=5) == [pytest.approx(2 / 3), 0.5, 1.0, 1.0, None]


def test_interleaved_runs_rotate_the_order_of_methods_each_repeat():
    from failfast.bench.timing import interleaved_runs

    calls: list[str] = []
    methods = {name: (lambda name=name: calls.append(name) or name) for name in "abc"}
    times, outputs = interleaved_runs(methods, repeats=3, warmup=1, rotation=1)
    assert calls == list("abc") + list("bca") + list("cab") + list("abc")  # warm-up in order, then rotated
    assert outputs == {"a": "a", "b": "b", "c": "c"} and all(len(t) == 3 for t in times.values())
