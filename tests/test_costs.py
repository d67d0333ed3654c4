"""The measured cost profile and the cost-aware draft-length policy."""

from __future__ import annotations

import pytest

from failfast import PolicyError, load_model, make_drafter
from failfast.decode.costs import VERIFY_POINTS, CostProfile, _interleaved_median_ms, measure_costs
from failfast.decode.calibration import AcceptanceCalibrator
from failfast.decode.policies import CostAware
from tests.helpers import prompt_of

FLAT = CostProfile(((1, 20.0), (64, 20.0)), draft_ms_per_token=0.5)       # verification is free (GPU-like)
STEEP = CostProfile(((1, 20.0), (2, 40.0)), draft_ms_per_token=0.5)      # every verified token costs 20 ms


def test_verify_cost_interpolates_between_points_and_extends_past_the_last():
    p = CostProfile(((1, 10.0), (5, 30.0), (9, 34.0)), draft_ms_per_token=1.0)
    assert p.verify_ms(1) == 10.0 and p.verify_ms(3) == 20.0 and p.verify_ms(7) == 32.0
    assert p.verify_ms(13) == 38.0  # slope of the last segment
    assert p.verify_ms(0) == 10.0


@pytest.mark.parametrize("points", [((1, 10.0),), ((4, 10.0), (2, 12.0)), ((1, -1.0), (2, 3.0))])
def test_bad_cost_profiles_are_refused(points):
    with pytest.raises(ValueError):
        CostProfile(points, 1.0)


def test_confident_drafts_grow_to_the_maximum_when_verification_is_cheap():
    policy = CostAware(FLAT, chunk=8, max_draft=20)
    assert policy.request([]) == 8
    assert policy.request([0.99] * 8) == 8
    assert policy.request([0.99] * 16) == 4       # capped by N_max
    assert policy.request([0.99] * 20) == 0


def test_unlikely_drafts_stop():
    assert CostAware(FLAT).request([0.9, 0.01, 0.5, 0.5]) == 0  # the survival chance is ~1%


def test_the_same_confidences_stop_earlier_when_verification_is_expensive():
    confs = [0.9] * 8
    assert CostAware(FLAT).request(confs) > 0
    assert CostAware(STEEP).request(confs) == 0


def test_bad_chunk_is_refused():
    with pytest.raises(PolicyError, match="chunk"):
        CostAware(FLAT, chunk=0)
    with pytest.raises(PolicyError, match="chunk"):
        CostAware(FLAT, chunk=10, max_draft=5)


def test_measure_costs_times_every_point(random_models):
    target = load_model(random_models["target"])
    drafter = make_drafter(target, load_model(random_models["random-dllm"]))
    profile = measure_costs(target, drafter, prompt_of(12), repeats=1)
    assert [k for k, _ in profile.verify_points] == list(VERIFY_POINTS)
    assert profile.draft_ms_per_token > 0
    assert drafter.forwards > 0


def test_drafts_are_timed_in_the_policys_chunks(random_models):
    """A sliding block-diffusion window drafts one request per pass: timing one request of 16
    tokens would price a chunk of 4 at a quarter of its passes."""
    target = load_model(random_models["target"])
    drafter = make_drafter(target, load_model(random_models["random-dllm"]))
    asked: list[int] = []
    real = drafter.draft
    drafter.draft = lambda count: asked.append(count) or real(count)
    measure_costs(target, drafter, prompt_of(12), repeats=1, chunk=4)
    assert asked and max(asked) == 4
    one_request = make_drafter(target, load_model(random_models["random-dllm"]))
    measure_costs(target, one_request, prompt_of(12), repeats=1)
    assert drafter.forwards > one_request.forwards  # more passes for the same 16 tokens


def test_a_block_drafter_is_timed_on_one_pass(random_models):
    """A DFlash pass drafts block_size - 1 tokens; timing 16 would add a second pass for one token."""
    target = load_model(random_models["target"])
    drafter = make_drafter(target, load_model(random_models["random-dflash"]))
    measure_costs(target, drafter, prompt_of(12), repeats=3)
    assert drafter.tokens_per_pass == drafter.block_size - 1
    assert drafter.forwards == 1 + 3  # the warm-up and each repeat: one pass


def test_calibrator_starts_at_each_bins_centre_and_learns_reached_tokens_only():
    cal = AcceptanceCalibrator(bins=10, prior=4.0)
    assert cal.probability(0.03) == pytest.approx(0.05) and cal.probability(0.97) == pytest.approx(0.95)
    assert cal.probability(1.0) == pytest.approx(0.95)  # confidence 1 falls in the top bin
    cal.observe([0.03, 0.03, 0.97, 0.97], accepted=2)  # two accepted, the third rejected, the fourth never reached
    assert cal.probability(0.03) == pytest.approx((0.2 + 2) / (4 + 2))
    assert cal.probability(0.97) == pytest.approx(3.8 / 5)
    for _ in range(200):
        cal.observe([0.03], accepted=1)
    assert cal.probability(0.03) > 0.95  # an underconfident drafter's low confidences are learned to be safe


def test_verification_is_cut_to_the_prefix_worth_its_cost():
    likely_head = [0.95, 0.95, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05]
    assert CostAware(FLAT).verify_count(likely_head) == 8  # free verification: verify everything
    assert CostAware(STEEP).verify_count(likely_head) == 2
    assert CostAware(STEEP).verify_count([0.05] * 8) == 0
    assert CostAware(STEEP).verify_count([]) == 0


def test_observed_acceptances_lengthen_what_is_verified():
    policy = CostAware(STEEP)
    confs = [0.35] * 6
    before = policy.verify_count(confs)
    for _ in range(100):
        policy.observe(confs, accepted=6)  # tokens at confidence 0.35 turn out always accepted
    assert before < 6 == policy.verify_count(confs)


def test_costs_are_timed_in_turn_after_one_warm_up_each():
    calls: list[str] = []
    medians = _interleaved_median_ms([lambda: calls.append("a"), lambda: calls.append("b")], repeats=3)
    assert calls == ["a", "b"] * 4 and len(medians) == 2 and all(ms >= 0 for ms in medians)
