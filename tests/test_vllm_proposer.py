"""The vLLM proposer's contract, driven the way vLLM's model runner calls it (no vLLM needed):
per-row drafts equal failfast's own drafting, rows that change requests start over, rows
still prefilling or at the length limit get none."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from failfast import FailFast, load_model, make_drafter
from failfast.decode.drafting import draft_alone
from failfast.decode.gate import SpeculationGate
from failfast.drafters.lookup import LookupDrafter, LookupSettings
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.integrations.vllm import CONFIG_ENV, FailFastProposer, ProposerConfig
from tests.helpers import prompt_of

MAX_LEN = 256


def _vllm_config(target_dir, k: int) -> SimpleNamespace:
    """The parts of vLLM's VllmConfig the proposer reads."""
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(model=str(target_dir), max_model_len=MAX_LEN))


def _table(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's token table [rows, max_model_len] and each row's token count."""
    table = np.zeros((len(rows), MAX_LEN), dtype=np.int32)
    for i, ids in enumerate(rows):
        table[i, :len(ids)] = ids
    return table, np.array([len(ids) for ids in rows], dtype=np.int32)


def _expected(target_dir, drafter_dir, policy, committed: list[int], budget: int,
              lookup_tokens: int | None = None) -> list[int]:
    """What a fresh failfast drafter (behind prompt lookup, with `lookup_tokens`) drafts after `committed`."""
    target = load_model(target_dir, dtype=torch.float64)
    drafter = make_drafter(target, load_model(drafter_dir, dtype=torch.float64))
    if lookup_tokens is not None:
        drafter = LookupDrafter(drafter, LookupSettings(max_tokens=lookup_tokens))
    drafter.prepare(MAX_LEN)
    return draft_alone(drafter, policy, committed, budget)[0]


def _step(proposer, rows: list[list[int]], sampled: list[list[int]]) -> list[list[int]]:
    table, counts = _table(rows)
    return proposer.propose(sampled, counts, table, slot_mappings=None)


@pytest.mark.parametrize("batched,lookup", [(True, None), (False, None), (True, 6)])
@pytest.mark.parametrize("pair", ["trained_pair", "random_ar"])
def test_rows_draft_what_failfast_drafts_as_requests_come_and_go(request, pair, batched, lookup):
    if pair == "random_ar":
        models = request.getfixturevalue("random_models")
        target_dir, drafter_dir = models["target"], models["random-ar"]
        a, b, c = prompt_of(9, seed=1), prompt_of(20, seed=2), prompt_of(5, seed=3)
    else:
        target_dir, drafter_dir = request.getfixturevalue(pair)
        a, b, c = list(range(3, 11)), list(range(20, 26)), [7, 8, 9]  # counting: long accepted drafts
    k = 24
    policy = FailFast(0.3, 8, k)
    proposer = FailFastProposer(_vllm_config(target_dir, k),
                                ProposerConfig(drafter=str(drafter_dir), tau=0.3, chunk=8, dtype="float64", batched=batched,
                                               gate=False, lookup_tokens=lookup))
    want = lambda ids, budget=k: _expected(target_dir, drafter_dir, policy, ids, budget, lookup)  # noqa: E731

    # step 1: two requests just prefilled (one sampled token each); a third still prefilling
    drafts = _step(proposer, [a, b, c[:2]], [[a[-1]], [b[-1]], []])
    assert drafts == [want(a), want(b), []]
    if pair == "trained_pair":
        assert len(drafts[0]) > 8  # FailFast extended a confident draft

    # step 2: a advanced by part of its draft plus a bonus token; b finished, c moved into its row
    a2 = a + drafts[0][:3] + [5]
    drafts = _step(proposer, [a2, c], [drafts[0][:3] + [5], [c[-1]]])
    assert drafts == [want(a2), want(c)]

    # step 3: rows swap places (vLLM condenses its batch); a row near the length limit drafts less
    long = (b * MAX_LEN)[:MAX_LEN - 5]
    drafts = _step(proposer, [c + [1], a2 + [2], long], [[1], [2], [long[-1]]])
    assert drafts == [want(c + [1]), want(a2 + [2]), want(long, 4)]
    assert len(drafts[2]) <= 4
    if lookup:
        assert proposer.rows[2].copied > 0  # the repeated row drafted copies


def test_the_gate_turns_whole_steps_plain(trained_pair):
    """A gate that probes after every leading step: the plain steps draft nothing for any row,
    the drafting steps still draft what failfast drafts."""
    target_dir, drafter_dir = trained_pair
    proposer = FailFastProposer(_vllm_config(target_dir, 16),
                                ProposerConfig(drafter=str(drafter_dir), tau=0.3, chunk=8, dtype="float64"),
                                gate=SpeculationGate(warmup=1, probe_every=1, max_probe_every=1, sample_rows=1))
    a, b = list(range(3, 11)), list(range(20, 26))
    policy = FailFast(0.3, 8, 16)
    kinds = []
    for step in range(6):
        drafts = _step(proposer, [a, b], [[a[-1]], [b[-1]]])
        kinds.append(bool(drafts[0]))
        if drafts[0]:
            assert drafts == [_expected(target_dir, drafter_dir, policy, ids, 16) for ids in (a, b)]
        else:
            assert drafts == [[], []]
        a, b = a + [a[-1] + 1], b + [b[-1] + 1]
    assert kinds[:2] == [True, False] and kinds.count(True) >= 2 and kinds.count(False) >= 2  # warm-up, then both


def test_config_comes_from_the_environment(monkeypatch, tmp_path, random_models):
    monkeypatch.setenv(CONFIG_ENV, '{"drafter": "ar-drafter", "tau": 0.2}')
    assert ProposerConfig.from_env() == ProposerConfig(drafter="ar-drafter", tau=0.2)
    path = tmp_path / "proposer.json"
    path.write_text('{"chunk": 4}')
    monkeypatch.setenv(CONFIG_ENV, str(path))
    assert ProposerConfig.from_env() == ProposerConfig(chunk=4)
    monkeypatch.setenv(CONFIG_ENV, ProposerConfig(drafter="x", batched=False).to_env()[CONFIG_ENV])
    assert ProposerConfig.from_env() == ProposerConfig(drafter="x", batched=False)
    for bad in ('{"tua": 0.2}', "[1]", "{nope"):
        monkeypatch.setenv(CONFIG_ENV, bad)
        with pytest.raises(GenerationInputError, match=CONFIG_ENV):
            ProposerConfig.from_env()


def test_feature_drafters_are_refused_with_a_reason(random_models):
    with pytest.raises(IncompatibleModelsError, match="hidden states"):
        FailFastProposer(_vllm_config(random_models["target"], 8),
                         ProposerConfig(drafter=str(random_models["random-dflash"]), dtype="float64"))


def test_the_policy_takes_the_drafter_kinds_defaults_unless_set(random_models):
    """tau and chunk left out: the drafter kind's FailFast settings, chunk capped by N_max."""
    target, dllm = random_models["target"], str(random_models["random-dllm"])
    cfg = load_model(random_models["random-dllm"]).config
    proposer = FailFastProposer(_vllm_config(target, 16), ProposerConfig(drafter=dllm, dtype="float64"))
    assert proposer.policy == FailFast(0.6, min(4, cfg.sub_block_size), 16)
    proposer = FailFastProposer(_vllm_config(target, 2), ProposerConfig(drafter=dllm, tau=0.2, dtype="float64"))
    assert proposer.policy == FailFast(0.2, 2, 2)
