"""Prompt lookup: what it copies, and that drafts with copies stay the target's tokens (float64)."""

from __future__ import annotations

import pytest
import torch

from failfast import FailFast, Fixed, SpeculativeEngine, load_model, make_drafter
from failfast.decode.engine import GenerationRequest
from failfast.decode.policies import CostAware, failfast_for
from failfast.drafters.lookup import LookupDrafter, LookupSettings, NgramIndex
from failfast.errors import PolicyError
from tests.helpers import prompt_of
from tests.synthetic import CYCLE
from tests.test_lossless import CPU_COSTS

MAX_NEW = 40


def test_the_longest_suffix_match_wins_and_its_latest_occurrence():
    index = NgramIndex(LookupSettings(min_ngram=1, max_ngram=3, max_tokens=3))
    # suffix [7, 8]: the bigram occurred at 1..2 (then 4) and at 5..6 (then 9); the unigram 8 also at 9..
    assert index.continuation([6, 7, 8, 4, 1, 7, 8, 9, 8, 7, 8]) == [9, 8, 7]
    assert NgramIndex(LookupSettings(min_ngram=2, max_ngram=2, max_tokens=2)).continuation([1, 2, 3, 4]) == []


def test_a_copy_that_reaches_the_end_repeats_itself():
    index = NgramIndex(LookupSettings(min_ngram=2, max_ngram=2, max_tokens=7))
    assert index.continuation([5, 1, 2, 1, 2]) == [1, 2, 1, 2, 1, 2, 1]


def test_a_growing_sequence_finds_what_a_fresh_index_finds():
    settings = LookupSettings(min_ngram=1, max_ngram=4, max_tokens=5)
    seq = prompt_of(60, seed=3)
    seq = [t % 7 for t in seq]  # a small alphabet: many matches
    grown = NgramIndex(settings)
    for end in range(1, len(seq) + 1, 3):
        assert grown.continuation(seq[:end]) == NgramIndex(settings).continuation(seq[:end])


def test_a_sequence_that_is_not_an_extension_starts_the_index_over():
    settings = LookupSettings(min_ngram=1, max_ngram=2, max_tokens=2)
    index = NgramIndex(settings)
    assert index.continuation([1, 2, 3, 1, 2]) == [3, 1]
    assert index.continuation([4, 2, 5, 2]) == [5, 2]  # not the first sequence's 2 -> 3
    assert index.continuation([4, 2, 5, 2, 4, 2]) == NgramIndex(settings).continuation([4, 2, 5, 2, 4, 2])


@pytest.mark.parametrize("bad", [dict(min_ngram=0), dict(min_ngram=3, max_ngram=2), dict(max_tokens=0)])
def test_bad_lookup_settings_are_refused(bad):
    with pytest.raises(PolicyError):
        LookupSettings(**bad)


def _lookup_drafter(target, models: dict, inner: str | None, settings: LookupSettings = LookupSettings()):
    drafter = None if inner is None else make_drafter(target, load_model(models[inner], dtype=torch.float64))
    return LookupDrafter(drafter, settings)


@pytest.mark.parametrize("inner", [None, "random-ar", "random-dllm", "random-dflash", "random-eagle3"])
def test_lookup_in_front_of_every_drafter_kind_is_lossless(random_models, inner):
    target = load_model(random_models["target"], dtype=torch.float64)
    plain = SpeculativeEngine(target)
    copied = 0
    for length in (1, 6, 17, 30):
        prompt = [t % 5 + 2 for t in prompt_of(length)]  # repeats: the lookup finds copies in the prompt
        expected = plain.generate(prompt, MAX_NEW).token_ids
        for policy in (Fixed(4), FailFast(tau=0.0, chunk=3, max_draft=20), CostAware(CPU_COSTS, chunk=4)):
            drafter = _lookup_drafter(target, random_models, inner, LookupSettings(min_ngram=1, max_tokens=6))
            result = SpeculativeEngine(target, drafter, policy).generate(prompt, MAX_NEW)
            assert result.token_ids == expected, (inner, policy.name, length)
            copied += drafter.copied
    assert copied > 0


def test_copies_of_a_cycle_are_accepted_and_the_drafter_drafts_where_nothing_repeats(trained_pair):
    """Counting modulo CYCLE: the first rounds have nothing to copy (the block-diffusion drafter
    drafts them); once the count wraps, every round copies the last cycle and the copy is right."""
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    prompt = list(range(3, 20))
    expected = SpeculativeEngine(target).generate(prompt, 90).token_ids
    inner = make_drafter(target, load_model(drafter_dir, dtype=torch.float64))
    drafter = LookupDrafter(inner, LookupSettings(max_tokens=8))
    result = SpeculativeEngine(target, drafter, FailFast(tau=0.45, chunk=4, max_draft=40)).generate(prompt, 90)
    assert result.token_ids == expected
    assert inner.forwards > 0 and drafter.copied >= 40  # both kinds of round happened
    assert result.stats.drafted > drafter.copied
    cycle = list(range(CYCLE)) + list(range(5))  # a prompt that holds a whole cycle: copies only
    drafter = LookupDrafter(make_drafter(target, load_model(drafter_dir, dtype=torch.float64)), LookupSettings())
    result = SpeculativeEngine(target, drafter, FailFast(tau=0.45, chunk=4, max_draft=40)).generate(cycle, 90)
    assert result.token_ids == SpeculativeEngine(target).generate(cycle, 90).token_ids
    assert drafter.forwards == 0 and result.stats.rounds == 10  # 8 copies + the target's token per round


@pytest.mark.parametrize("inner", [None, "random-dllm", "random-eagle3"])
def test_lookup_rows_in_a_batch_draft_what_they_draft_alone(random_models, inner):
    target = load_model(random_models["target"], dtype=torch.float64)
    prompts = [[t % 4 + 2 for t in prompt_of(n)] for n in (3, 9, 14, 21)]
    requests = [GenerationRequest(p, MAX_NEW) for p in prompts]
    engine = SpeculativeEngine(target, _lookup_drafter(target, random_models, inner, LookupSettings(min_ngram=1)),
                               FailFast(tau=0.0, chunk=3, max_draft=12))
    alone = [engine.generate(p, MAX_NEW) for p in prompts]
    together = dict(engine.generate_many(requests, batch_size=3))
    for i, result in enumerate(alone):
        assert together[i].token_ids == result.token_ids
        assert together[i].stats.drafted == result.stats.drafted  # the same drafts, not only the same output


def test_the_lookup_keeps_the_inner_drafters_failfast_settings(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    wrapped = _lookup_drafter(target, random_models, "random-eagle3")
    assert failfast_for(wrapped) == failfast_for(wrapped.inner)
    assert failfast_for(LookupDrafter(None, LookupSettings(max_tokens=6))).chunk == 6
