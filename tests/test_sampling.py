"""Exact sampling: with a seed, speculative output equals plain AR sampling token for token."""

from __future__ import annotations

import pytest
import torch

from failfast import (FailFast, Fixed, GenerationInputError, SamplingParams, SpeculativeEngine, load_model,
                      make_drafter)
from failfast.cli import main
from failfast.decode.sampling import Sampler, processed_logprobs
from failfast.model import Transformer
from tests.helpers import copy_checkpoint, prompt_of, set_eos, write_word_tokenizer

SETTINGS = [SamplingParams(0.7), SamplingParams(1.0), SamplingParams(1.0, top_k=10),
            SamplingParams(0.8, top_p=0.9), SamplingParams(1.3, top_k=5, top_p=0.8)]
POLICIES = [Fixed(3), FailFast(), FailFast(tau=0.0, chunk=4, max_draft=16)]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_k, params.top_p, seed)


def _drafter_options(drafter_name: str) -> tuple[str, dict]:
    """The checkpoint behind a drafter name, and its make_drafter options ("-causal": causal windows)."""
    return (drafter_name.removesuffix("-causal"), dict(denoise="causal")) if drafter_name.endswith("-causal") else (
        drafter_name, {})


@pytest.mark.parametrize("drafter_name", ["self", "random-ar", "random-dllm", "random-dllm-causal", "random-dflash",
                                          "random-eagle3"])
def test_random_drafters_reproduce_plain_sampling(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    name, options = _drafter_options(drafter_name)
    drafter = load_model(random_models[name], dtype=torch.float64)
    plain = SpeculativeEngine(target)
    for i, params in enumerate(SETTINGS):
        for seed in (0, 1, 2):
            sampling = _with_seed(params, seed)
            prompt = prompt_of(5 + 4 * i, seed)
            expected = plain.generate(prompt, 30, sampling).token_ids
            for policy in POLICIES:
                got = SpeculativeEngine(target, make_drafter(target, drafter, **options), policy).generate(
                    prompt, 30, sampling)
                assert got.token_ids == expected, (drafter_name, policy.name, params, seed)


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=3), SamplingParams(0.7, top_k=10, seed=4),
                                    SamplingParams(1.3, top_p=0.8, seed=5)])
def test_coupled_drafting_with_the_target_as_drafter_accepts_every_sampled_draft(random_models, params):
    """A drafter that samples with the verifier's noise proposes the target's own draw when
    its distribution is the target's: every draft token is accepted (a greedy draft would
    match a sampled token only by chance), and the output is still plain sampling's."""
    target = load_model(random_models["target"], dtype=torch.float64)
    expected = SpeculativeEngine(target).generate(prompt_of(6, 1), 40, params).token_ids
    got = SpeculativeEngine(target, make_drafter(target, target), Fixed(5)).generate(prompt_of(6, 1), 40, params)
    assert got.token_ids == expected
    assert got.stats.drafted > 30 and got.stats.accepted == got.stats.drafted
    greedy = SpeculativeEngine(target, make_drafter(target, target), Fixed(5), coupled_drafts=False).generate(
        prompt_of(6, 1), 40, params)
    assert greedy.token_ids == expected and greedy.stats.accepted < greedy.stats.drafted


@pytest.mark.parametrize("drafter_name", ["random-ar", "random-dllm", "random-dllm-causal", "random-dflash",
                                          "random-eagle3"])
def test_coupled_drafts_use_each_tokens_own_position(random_models, drafter_name):
    """With uniform logits everywhere (zeroed output heads) the target draws the argmax of a
    position's noise, and so does a coupled drafter if it reads the noise of the position it
    drafts: every draft token is accepted unless the target drew a token the drafter may not
    propose (a block-diffusion drafter's mask token). An off-by-one position would reject
    almost every draft."""
    target = load_model(random_models["target"], dtype=torch.float64)
    name, options = _drafter_options(drafter_name)
    drafter_model = load_model(random_models[name], dtype=torch.float64)
    for model in (target.model, drafter_model.model):  # DFlash and EAGLE-3 drafters use the target's head
        if isinstance(model, Transformer):
            model.lm_head.weight.data.zero_()
    drafter = make_drafter(target, drafter_model, full_vocab=True, **options)
    sampling = SamplingParams(1.0, seed=7)
    prompt = prompt_of(7, 2)
    expected = SpeculativeEngine(target).generate(prompt, 48, sampling).token_ids
    for policy in (Fixed(4), FailFast(tau=0.0, chunk=2, max_draft=8)):  # one draft call a round; several
        got = SpeculativeEngine(target, drafter, policy).generate(prompt, 48, sampling)
        assert got.token_ids == expected
        at, rejected = 0, []
        for r in got.stats.trajectory:
            if r.accepted < r.drafted:
                rejected.append(got.token_ids[at + r.accepted])  # the target's token where the draft went wrong
            at += r.accepted + 1
        assert got.stats.drafted >= 30 and set(rejected) <= set(drafter.banned), policy.name


def test_trained_drafter_reproduces_sampling_with_long_drafts(trained_pair):
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    for temperature in (0.7, 1.0):
        for seed in range(4):
            sampling = SamplingParams(temperature, seed=seed)
            for prompt in (list(range(3, 8)), list(range(10, 26))):
                expected = SpeculativeEngine(target).generate(prompt, 70, sampling).token_ids
                result = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(0.45, 10, 40)).generate(
                    prompt, 70, sampling)
                assert result.token_ids == expected
    assert max(r.accepted for r in result.stats.trajectory) >= 10  # sampling still accepts long drafts


def test_eos_stop_string_and_length_inside_drafts_when_sampling(trained_pair, tmp_path):
    target_dir, drafter_dir = trained_pair
    folder = copy_checkpoint(target_dir, tmp_path / "with-tokenizer")
    write_word_tokenizer(folder, 48)
    set_eos(folder, 21)
    target = load_model(folder, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    prompt = list(range(3, 8))
    cases = [dict(max_new_tokens=60), dict(max_new_tokens=60, stop=["<15> <16>"]), dict(max_new_tokens=9)]
    reasons = set()
    for case in cases:
        for seed in range(3):
            sampling = SamplingParams(0.7, seed=seed)
            expected = SpeculativeEngine(target).generate(prompt, sampling=sampling, **case)
            got = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(0.0, 10, 40)).generate(
                prompt, sampling=sampling, **case)
            assert (got.token_ids, got.text, got.stop_reason) == (expected.token_ids, expected.text, expected.stop_reason)
            reasons.add(got.stop_reason)
            if got.stop_reason == "stop":
                assert "<15> <16>" not in got.text and got.text == expected.text
    assert reasons == {"eos", "stop", "length"}


# Chi-square critical values at significance 0.001, by degrees of freedom.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.6), SamplingParams(1.5, top_k=4),
                                    SamplingParams(1.0, top_p=0.7), SamplingParams(0.9, top_k=5, top_p=0.85)])
def test_sampler_matches_the_processed_distribution(params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -2.0], dtype=torch.float64)
    expected = processed_logprobs(logits, params).exp()
    draws = 4000
    counts = torch.zeros(8)
    for seed in range(draws):
        counts[Sampler(SamplingParams(params.temperature, params.top_k, params.top_p, seed)).choose(logits, 17)] += 1
    support = expected > 0
    assert counts[~support].sum() == 0  # removed tokens are never drawn
    exp_counts = expected[support] * draws
    chi2 = float(((counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < CHI2_CRIT[int(support.sum()) - 1], (chi2, counts, exp_counts)
    # Across positions with one seed, the draws follow the same distribution.
    pos_counts = torch.zeros(8)
    sampler = Sampler(_with_seed(params, 5))
    for position in range(draws):
        pos_counts[sampler.choose(logits, position)] += 1
    chi2_pos = float(((pos_counts[support] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2_pos < CHI2_CRIT[int(support.sum()) - 1]


def test_same_seed_same_tokens_different_seed_different_tokens(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    engine = SpeculativeEngine(target)
    runs = [engine.generate([5, 6, 7], 30, SamplingParams(1.0, seed=s)).token_ids for s in (11, 11, 12)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"), (dict(temperature=1.0, top_k=-1), "top_k"),
])
def test_bad_sampling_parameters(kwargs, message):
    with pytest.raises(GenerationInputError, match=message):
        SamplingParams(**kwargs)


def test_empty_stop_sequence(random_models, tmp_path):
    folder = copy_checkpoint(random_models["target"], tmp_path / "tok")
    write_word_tokenizer(folder, 96)
    with pytest.raises(GenerationInputError, match="stop sequences must be non-empty"):
        SpeculativeEngine(load_model(folder)).generate([3], 5, stop=[""])


@pytest.mark.parametrize("flag, value", [("--temperature", "-1"), ("--top-p", "0"), ("--top-k", "-2")])
def test_cli_rejects_bad_sampling_flags(target_dir, capsys, flag, value):
    code = main(["generate", "--target", str(target_dir), "--prompt-ids", "3,4", "--max-new-tokens", "3", flag, value])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and flag.strip("-").replace("-", "_") in err
