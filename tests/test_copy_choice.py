"""Copy or model draft per round: measured rates decide, and the outcome of a round is read
correctly from the committed sequence (the output stays the target's: test_lookup.py)."""

from __future__ import annotations

import itertools

import torch

from failfast import FailFast, SpeculativeEngine, load_model, make_drafter
from failfast.drafters.copy_choice import EXPLORE_EVERY, MODEL_ROUND, CopyChoice, TimedRound
from failfast.drafters.lookup import LookupDrafter, LookupSettings


class StepClock:
    """A clock that reads the time it is set to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_unmeasured_arms_are_tried_before_a_measured_one():
    choice = CopyChoice(StepClock())
    assert choice.prefer_copy(2)  # nothing measured: copy
    choice.record(2, tokens=3, seconds=1.0)
    assert not choice.prefer_copy(2)  # the model drafter is unmeasured: try it
    choice.record(MODEL_ROUND, tokens=2, seconds=1.0)
    assert choice.prefer_copy(2)  # 3 tokens/s beat 2
    assert choice.prefer_copy(1)  # a match length never measured is tried


def test_the_faster_arm_wins_except_every_explore_every_th_choice():
    choice = CopyChoice(StepClock())
    choice.record(1, tokens=1, seconds=1.0)
    choice.record(MODEL_ROUND, tokens=5, seconds=1.0)
    picks = [choice.prefer_copy(1) for _ in range(3 * EXPLORE_EVERY)]
    assert picks.count(True) == 3  # the slower copy, drafted once per EXPLORE_EVERY choices
    assert all(picks[i] == ((i + 1) % EXPLORE_EVERY == 0) for i in range(len(picks)))


def test_recent_rounds_outweigh_old_ones():
    choice = CopyChoice(StepClock())
    for _ in range(5):
        choice.record(3, tokens=8, seconds=1.0)
    choice.record(MODEL_ROUND, tokens=4, seconds=1.0)
    assert choice.rate(3) > choice.rate(MODEL_ROUND)
    for _ in range(30):  # the text changed: copies now fail
        choice.record(3, tokens=1, seconds=1.0)
    assert choice.rate(3) < 1.5 < choice.rate(MODEL_ROUND)


def _round(committed: list[int], drafted: list[int], clock: StepClock) -> tuple[CopyChoice, TimedRound]:
    choice = CopyChoice(clock)
    timed = TimedRound(choice, 2, committed)
    timed.drafted += drafted
    clock.now += 0.5
    return choice, timed


def test_a_round_is_credited_with_its_committed_tokens_and_time():
    clock = StepClock()
    choice, timed = _round([1, 2, 3], [4, 5, 6], clock)
    timed.settle([1, 2, 3, 4, 5, 9])  # two accepted, then the target's own token
    assert (choice.tallies[2].tokens, choice.tallies[2].seconds) == (3, 0.5)
    choice, timed = _round([1, 2, 3], [4, 5, 6], clock)
    timed.settle([1, 2, 3, 4, 5, 6, 7])  # all accepted plus one
    assert choice.tallies[2].tokens == 4
    choice, timed = _round([1, 2, 3], [4, 5, 6], clock)
    timed.settle([1, 2, 3, 4, 5])  # a verified prefix [4] whose next target token matched the draft
    assert choice.tallies[2].tokens == 2


def test_rounds_that_cannot_be_read_are_left_out():
    clock = StepClock()
    choice, timed = _round([1, 2, 3], [4, 5, 6], clock)
    timed.settle([1, 2, 3, 4, 8, 8, 8])  # plain rounds ran in between (a speculation gate)
    timed.settle([7, 2, 3, 4, 9])  # another sequence (a vLLM row's next request)
    timed.settle([1, 2, 3])  # nothing committed
    assert choice.tallies == {}


def test_measured_rates_steer_the_drafter_in_an_engine(trained_pair):
    """Counting modulo CYCLE with a prompt that holds a whole cycle: every round could copy.
    Rates seeded so that the model drafter is far faster: it drafts the rounds, the copies
    come only from exploring; seeded the other way, copies draft every round."""
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    prompt = list(range(3, 30))
    expected = SpeculativeEngine(target).generate(prompt, 90).token_ids
    for model_fast in (True, False):
        choice = CopyChoice(itertools.count().__next__)  # every round lasts one tick
        for arm in range(5):
            fast = (arm == MODEL_ROUND) == model_fast
            choice.record(arm, tokens=10_000 if fast else 1, seconds=1.0)
        inner = make_drafter(target, load_model(drafter_dir, dtype=torch.float64))
        drafter = LookupDrafter(inner, LookupSettings(), choice)
        result = SpeculativeEngine(target, drafter, FailFast(tau=0.45, chunk=4, max_draft=40)).generate(prompt, 90)
        assert result.token_ids == expected
        explored = result.stats.rounds // EXPLORE_EVERY + 1  # rounds that may draft the slower arm
        if model_fast:  # copy rounds serve 8 tokens each: at most the explored ones copied
            assert inner.forwards > 0 and drafter.copied <= 8 * explored
        else:  # all but the explored rounds copied 8 tokens (the last one maybe fewer)
            assert drafter.copied >= 8 * (result.stats.rounds - explored - 1) > 0
