"""The speculation gate: which kind of round it picks, and that skipping drafts never changes the output."""

from __future__ import annotations

import pytest
import torch

from failfast import FailFast, Fixed, SamplingParams, SpeculativeEngine, load_model, make_drafter
from failfast.decode.engine import GenerationRequest
from failfast.decode.gate import SpeculationGate, batch_bucket
from failfast.errors import GenerationInputError, PolicyError
from tests.helpers import prompt_of


def _run(gate: SpeculationGate, rows: int, rates: dict[bool, float], rounds: int) -> list[bool]:
    """Drive the gate for `rounds` rounds whose rates are given per kind; the kinds it chose."""
    chosen = []
    for _ in range(rounds):
        kind = gate.speculate(rows)
        gate.record(rows, kind, tokens=int(rates[kind]), seconds=1.0)
        chosen.append(kind)
    return chosen


def test_the_gate_runs_the_faster_kind_and_probes_the_other_less_and_less():
    gate = SpeculationGate(warmup=2, probe_every=4, max_probe_every=16)
    chosen = _run(gate, 16, {True: 300, False: 500}, 2 + 2 + 4 + 1 + 8 + 1 + 16 + 1 + 16 + 1)
    assert chosen[:4] == [True, True, False, False]  # warm-up: two rounds of each kind
    # probes that keep the leader double the wait, up to max_probe_every
    assert chosen[4:] == [False] * 4 + [True] + [False] * 8 + [True] + [False] * 16 + [True] + [False] * 16 + [True]
    # where drafts pay (two rows), the same gate speculates, separately from the 16-row bucket;
    # a sample there spans 4 rounds (8 row-rounds)
    assert _run(gate, 2, {True: 200, False: 90}, 20) == [True] * 8 + [False] * 8 + [True] * 4
    assert _run(gate, 17, {True: 300, False: 500}, 17) == [False] * 16 + [True]  # 17 shares the 16 bucket


def test_a_probe_that_turns_out_faster_takes_over():
    gate = SpeculationGate(warmup=1, probe_every=2, smoothing=1.0, sample_rows=1)
    _run(gate, 4, {True: 100, False: 200}, 2)
    assert _run(gate, 4, {True: 300, False: 200}, 5) == [False, False, True, True, True]


def test_a_probe_replaces_a_stale_average_from_slow_first_rounds():
    """The engine's first rounds are slow whatever their kind: a speculative warm-up there must
    not keep drafting measured slow once a probe sees it faster (smoothing stays for the leader)."""
    gate = SpeculationGate(warmup=1, probe_every=2, smoothing=0.2, sample_rows=1)
    _run(gate, 1, {True: 10, False: 200}, 2)  # a cold speculative warm-up, then a warm plain one
    assert _run(gate, 1, {True: 300, False: 200}, 5) == [False, False, True, True, True]


def test_buckets_are_powers_of_two():
    assert [batch_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 63, 64)] == [1, 1, 2, 2, 4, 4, 8, 32, 64]


@pytest.mark.parametrize("settings", [dict(warmup=0), dict(probe_every=0), dict(probe_every=8, max_probe_every=4),
                                      dict(sample_rows=0),
                                      dict(smoothing=0.0), dict(smoothing=1.5)])
def test_bad_gate_settings_are_clear_errors(settings):
    with pytest.raises(PolicyError):
        SpeculationGate(**settings)


def test_a_gate_needs_a_drafter(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    with pytest.raises(GenerationInputError, match="gate needs a drafter"):
        SpeculativeEngine(target, gate=SpeculationGate())


def _alternating() -> SpeculationGate:
    """After one round of each kind, every other round is a probe: plain and speculative
    rounds alternate, whatever the timings."""
    return SpeculationGate(warmup=1, probe_every=1, max_probe_every=1, sample_rows=1)


def _check_gated_equals_ungated(target, drafter, policy, requests):
    ungated = SpeculativeEngine(target, drafter, policy)
    want = [ungated.generate(r.prompt_ids, r.max_new_tokens, r.sampling).token_ids for r in requests]
    for batch_size in (1, 3):
        gated = SpeculativeEngine(target, drafter, policy, gate=_alternating())
        got = dict(gated.generate_many(requests, batch_size))
        assert [got[i].token_ids for i in range(len(requests))] == want, batch_size
        drafted = [x.drafted for i in got for x in got[i].stats.trajectory]
        assert 0 in drafted and max(drafted) > 0  # both kinds of round ran


@pytest.mark.parametrize("drafter_name", ["random-ar", "random-dllm", "random-dflash", "random-eagle3"])
def test_gated_rounds_keep_the_output_of_random_drafters(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = make_drafter(target, load_model(random_models[drafter_name], dtype=torch.float64))
    requests = [GenerationRequest(prompt_of(n, seed=i), m, SamplingParams(0.9, seed=i) if i % 2 else None)
                for i, (n, m) in enumerate(zip([3, 9, 17, 30], [30, 12, 25, 20]))]
    _check_gated_equals_ungated(target, drafter, Fixed(4), requests)


@pytest.mark.parametrize("pair", ["trained_pair", "trained_dflash", "trained_eagle3"])
def test_gated_rounds_keep_the_output_of_long_accepted_drafts(request, pair):
    """Trained drafters accept long drafts: the rounds after a plain round must pick up
    exactly where the committed tokens are (features and caches included)."""
    target_dir, drafter_dir = request.getfixturevalue(pair)
    target = load_model(target_dir, dtype=torch.float64)
    drafter = make_drafter(target, load_model(drafter_dir, dtype=torch.float64))
    requests = [GenerationRequest(list(range(3, 8)), 50), GenerationRequest(list(range(21, 30)), 40),
                GenerationRequest([5], 30, SamplingParams(1.0, seed=4))]
    _check_gated_equals_ungated(target, drafter, FailFast(0.3, 8, 32), requests)
