"""Penalties (repetition, presence, frequency): speculative output equals plain decoding with
the same penalties, which equals transformers' (repetition) or a from-scratch loop (float64)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from transformers import Qwen2ForCausalLM

from failfast import (FailFast, Fixed, GenerationInputError, GenerationRequest, SamplingParams, SpeculativeEngine,
                      load_model, make_drafter)
from failfast.decode.sampling import apply_penalties
from failfast.drafters.factory import DRAFT_VOCAB_FILE
from tests.helpers import copy_checkpoint, prompt_of, set_eos, write_word_tokenizer
from tests.test_lossless import hf_greedy

DRAFTERS = ["self", "random-ar", "random-dllm", "random-dflash", "random-eagle3"]
POLICIES = [Fixed(4), FailFast(), FailFast(tau=0.0, chunk=3, max_draft=12)]


def reference_openai_penalties(folder, prompt: list[int], max_new: int, presence: float, frequency: float) -> list[int]:
    """Greedy decoding that recomputes every step from scratch and penalizes by OpenAI's rule:
    logit -= frequency * count + presence * (count > 0), counts over the output so far."""
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for token, count in Counter(ids[len(prompt):]).items():
                logits[token] -= frequency * count + presence
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_repetition_penalty_is_transformers_greedy_for_every_drafter(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models[drafter_name], dtype=torch.float64)
    for length, penalty in ((3, 1.5), (12, 3.0)):
        prompt = prompt_of(length)
        expected = hf_greedy(random_models["target"], prompt, 30, repetition_penalty=penalty)
        assert expected != hf_greedy(random_models["target"], prompt, 30)  # the penalty matters here
        sampling = SamplingParams(repetition_penalty=penalty)
        assert SpeculativeEngine(target).generate(prompt, 30, sampling).token_ids == expected
        for policy in POLICIES:
            got = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(prompt, 30, sampling)
            assert got.token_ids == expected, (drafter_name, policy.name, penalty)


@pytest.mark.parametrize("drafter_name", ["random-ar", "random-dllm", "random-dflash"])
def test_presence_and_frequency_penalties_follow_openai_rule(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models[drafter_name], dtype=torch.float64)
    prompt = prompt_of(6)
    for presence, frequency in ((0.0, 0.7), (1.5, 0.0), (-0.4, 0.3)):
        expected = reference_openai_penalties(random_models["target"], prompt, 25, presence, frequency)
        sampling = SamplingParams(presence_penalty=presence, frequency_penalty=frequency)
        assert SpeculativeEngine(target).generate(prompt, 25, sampling).token_ids == expected
        for policy in POLICIES:
            got = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(prompt, 25, sampling)
            assert got.token_ids == expected, (drafter_name, policy.name, presence, frequency)
    assert expected != hf_greedy(random_models["target"], prompt, 25)


def test_trained_pair_with_a_penalty_is_transformers_with_long_drafts(trained_pair):
    target_dir, drafter_dir = trained_pair
    target, drafter = load_model(target_dir, dtype=torch.float64), load_model(drafter_dir, dtype=torch.float64)
    prompt = list(range(3, 8))
    expected = hf_greedy(target_dir, prompt, 60, repetition_penalty=1.3)
    for policy in (FailFast(tau=0.45, chunk=10, max_draft=40), Fixed(12)):
        got = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(
            prompt, 60, SamplingParams(repetition_penalty=1.3))
        assert got.token_ids == expected, policy.name
        assert max(r.accepted for r in got.stats.trajectory) >= 8  # drafts are still accepted at length


@pytest.mark.parametrize("drafter_name", ["self", "random-dllm", "random-dflash", "random-eagle3"])
def test_sampling_with_penalties_reproduces_plain_sampling(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models[drafter_name], dtype=torch.float64)
    plain = SpeculativeEngine(target)
    for seed, params in enumerate([SamplingParams(0.8, repetition_penalty=3.0, presence_penalty=1.0),
                                   SamplingParams(1.0, top_k=8, presence_penalty=2.0),
                                   SamplingParams(0.7, top_p=0.9, frequency_penalty=1.5, repetition_penalty=1.5)]):
        sampling = SamplingParams(params.temperature, params.top_k, params.top_p, seed, params.repetition_penalty,
                                  params.presence_penalty, params.frequency_penalty)
        prompt = prompt_of(4 + 3 * seed, seed)
        expected = plain.generate(prompt, 30, sampling).token_ids
        assert expected != plain.generate(prompt, 30, SamplingParams(params.temperature, params.top_k, params.top_p,
                                                                     seed)).token_ids
        for policy in POLICIES:
            got = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(prompt, 30, sampling)
            assert got.token_ids == expected, (drafter_name, policy.name, params)


def test_a_batch_mixing_penalized_and_plain_rows_equals_each_alone(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["random-dllm"], dtype=torch.float64)
    engine = SpeculativeEngine(target, make_drafter(target, drafter), FailFast())
    requests = [GenerationRequest(prompt_of(5 + i, i), 24, SamplingParams(**options)) for i, options in enumerate(
        [dict(repetition_penalty=1.5), {}, dict(temperature=0.9, seed=2, frequency_penalty=0.8), dict(temperature=0.9, seed=2)])]
    alone = [SpeculativeEngine(target).generate(r.prompt_ids, r.max_new_tokens, r.sampling).token_ids for r in requests]
    together = dict(engine.generate_many(requests, batch_size=4))
    assert [together[i].token_ids for i in range(len(requests))] == alone


def test_penalties_per_verification_row_count_the_draft_prefix():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]] * 3, dtype=torch.float64)
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    out = apply_penalties(logits, params, prompt_ids={3}, output_counts=Counter([0]), draft=[2, 2])
    # row 0 follows the output [0]; row 1 also a drafted 2; row 2 two of them (the prompt's 3 is seen, not counted)
    assert out.tolist() == [[1.0 - 0.75, -1.0, 0.5, 0.5],
                            [1.0 - 0.75, -1.0, 0.25 - 0.75, 0.5],
                            [1.0 - 0.75, -1.0, 0.25 - 1.0, 0.5]]
    # over a draft vocabulary: the columns are token ids 3 and 0
    cols = apply_penalties(logits[:1, :2], params, prompt_ids={3}, output_counts=Counter([0]), columns=[0, 3])
    assert cols.tolist() == [[2.0 / 2 - 0.75, -1.0 * 2]]
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 1.0]  # the caller's logits are left alone


def test_penalties_with_a_draft_vocabulary_bucketed_shapes_stop_strings_and_eos(random_models, tmp_path):
    """The paths around the choice: a drafter over a reduced vocabulary (penalized by column),
    padded batch forwards, a stop string and an EOS inside a draft; every row equals its
    plain, unbatched run."""
    folder = copy_checkpoint(random_models["random-dllm"], tmp_path / "drafter")
    (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": list(range(2, 90, 2))}))
    target_dir = copy_checkpoint(random_models["target"], tmp_path / "target")
    write_word_tokenizer(target_dir, 96)
    plain_target = load_model(target_dir, dtype=torch.float64)
    eos = SpeculativeEngine(plain_target).generate(prompt_of(7), 20, SamplingParams(repetition_penalty=2.0)).token_ids[12]
    set_eos(target_dir, eos)
    target = load_model(target_dir, dtype=torch.float64)
    drafter = make_drafter(target, load_model(folder, dtype=torch.float64))
    assert drafter.vocab_list is not None
    words = SpeculativeEngine(target).generate(prompt_of(4), 30, SamplingParams(frequency_penalty=1.0)).text.split()
    stop = words[len(words) // 2]
    requests = [GenerationRequest(prompt_of(7), 20, SamplingParams(repetition_penalty=2.0)),
                GenerationRequest(prompt_of(4), 30, SamplingParams(frequency_penalty=1.0), stop=(stop,)),
                GenerationRequest(prompt_of(9, 1), 25, SamplingParams(0.9, seed=5, presence_penalty=1.5)),
                GenerationRequest(prompt_of(5, 2), 25)]
    plain = SpeculativeEngine(target)
    want = [plain.generate(r.prompt_ids, r.max_new_tokens, r.sampling, r.stop) for r in requests]
    assert want[0].stop_reason == "eos" and want[1].stop_reason == "stop"
    for bucketed in (False, True):
        engine = SpeculativeEngine(target, drafter, FailFast(tau=0.0, chunk=3, max_draft=12), bucketed_shapes=bucketed)
        for batch_size in (1, len(requests)):
            got = dict(engine.generate_many(requests, batch_size))
            assert [(got[i].token_ids, got[i].stop_reason) for i in range(len(requests))] == \
                   [(w.token_ids, w.stop_reason) for w in want], (bucketed, batch_size)


@pytest.mark.parametrize("options", [dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0),
                                     dict(repetition_penalty=1e-46), dict(frequency_penalty=1e39),
                                     dict(presence_penalty=10 ** 400), dict(temperature=10 ** 400),
                                     dict(presence_penalty=float("nan")), dict(frequency_penalty=float("inf"))])
def test_bad_penalties_are_refused(options):
    with pytest.raises(GenerationInputError):
        SamplingParams(**options)
