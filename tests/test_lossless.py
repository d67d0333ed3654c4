"""Every drafter x policy yields exactly transformers' greedy tokens (float64, CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from failfast import FailFast, Fixed, SpeculativeEngine, load_model, make_drafter
from failfast.decode.costs import CostProfile
from failfast.decode.policies import CostAware
from tests.helpers import copy_checkpoint, prompt_of, set_eos
from tests.synthetic import BLOCK

# A CPU-like cost profile: verifying more tokens costs more, so CostAware's stops matter.
CPU_COSTS = CostProfile(((1, 25.0), (8, 38.0), (64, 70.0)), draft_ms_per_token=0.8)
POLICIES = [Fixed(1), Fixed(4), Fixed(11), FailFast(), FailFast(tau=0.0, chunk=3, max_draft=20),
            CostAware(CPU_COSTS, chunk=4, max_draft=24)]
PROMPT_LENGTHS = [1, 2, 7, 8, 9, 16, 17, 30]  # drafter block size is 8
MAX_NEW = 40


def hf_greedy(folder: Path, prompt: list[int], max_new: int, eos: int | None = None, **options) -> list[int]:
    """`transformers`' greedy continuation (float64); `options` go to `generate` (e.g. repetition_penalty)."""
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         **options)
    return out[0, len(prompt):].tolist()


# Mask-token drafting options: sliding windows (the default of a checkpoint that names none),
# aligned prefix passes, Fast-dLLM v2's sub-block passes and exact full-block passes, at one
# pass per window (threshold 0, default) and at the paper's; causal windows.
DLLM_OPTIONS = {"random-dllm": {}, "random-dllm-causal": dict(denoise="causal"), "random-dllm-prefix": dict(denoise="prefix"),
                "random-dllm-sub-block": dict(denoise="sub-block"),
                "random-dllm-full-block": dict(denoise="full-block", unmask_threshold=0.05)}


@pytest.mark.parametrize("drafter_name", ["self", "random-ar", *DLLM_OPTIONS, "random-dflash", "random-eagle3"])
def test_random_drafters_are_lossless(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    options = DLLM_OPTIONS.get(drafter_name, {})
    drafter = load_model(random_models["random-dllm" if drafter_name in DLLM_OPTIONS else drafter_name], dtype=torch.float64)
    for length in PROMPT_LENGTHS:
        prompt = prompt_of(length)
        expected = hf_greedy(random_models["target"], prompt, MAX_NEW)
        assert SpeculativeEngine(target).generate(prompt, MAX_NEW).token_ids == expected
        for policy in POLICIES:
            result = SpeculativeEngine(target, make_drafter(target, drafter, **options), policy).generate(prompt, MAX_NEW)
            assert result.token_ids == expected, (drafter_name, policy.name, length)
            assert result.stats.tokens == MAX_NEW and result.stop_reason == "length"
            if drafter_name == "self":
                assert result.stats.accepted == result.stats.drafted  # full acceptance


def test_random_drafter_accepts_almost_nothing(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["random-ar"], dtype=torch.float64)
    stats = SpeculativeEngine(target, make_drafter(target, drafter), Fixed(4)).generate(prompt_of(9), MAX_NEW).stats
    assert stats.acceptance_rate < 0.2 and stats.rounds > MAX_NEW // 2


@pytest.mark.parametrize("prompt", [list(range(3, 8)), list(range(10, 18)), list(range(20, 33)),
                                    list(range(0, 16)), [5]])
def test_trained_block_diffusion_drafter_is_lossless_with_long_drafts(trained_pair, prompt):
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    expected = hf_greedy(target_dir, prompt, 90)
    for options in ({}, dict(denoise="causal"), dict(denoise="prefix"), dict(denoise="sub-block"), dict(denoise="full-block"),
                    dict(unmask_threshold=0.05), dict(sub_block_size=8), dict(denoise="prefix", sub_block_size=8)):
        for policy in (FailFast(tau=0.45, chunk=10, max_draft=40), Fixed(20), Fixed(3), CostAware(CPU_COSTS)):
            result = SpeculativeEngine(target, make_drafter(target, drafter, **options), policy).generate(prompt, 90)
            assert result.token_ids == expected, (policy.name, options)
    # A drafter in another dtype than the target (float32 drafting for a float64 target) changes
    # drafting cost only; drafts spanning several blocks are still accepted whole.
    for drafter_dtype in (torch.float64, torch.float32):
        drafter = load_model(drafter_dir, dtype=drafter_dtype)
        result = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(0.45, 10, 40)).generate(prompt, 90)
        assert result.token_ids == expected, drafter_dtype
        assert max(r.accepted for r in result.stats.trajectory) >= 2 * BLOCK
        assert result.stats.tokens_per_round > 4


def _emitted_in_last_round(result) -> int:
    earlier = sum(r.accepted + 1 for r in result.stats.trajectory[:-1])
    return result.stats.tokens - earlier


def test_eos_inside_a_draft(trained_pair, tmp_path):
    target_dir, drafter_dir = trained_pair
    prompt = list(range(3, 8))
    eos = 20  # the counting sequence reaches it 13 tokens after the prompt
    folder = copy_checkpoint(target_dir, tmp_path / "target-eos")
    set_eos(folder, eos)
    expected = hf_greedy(folder, prompt, 60, eos=eos)
    assert expected[-1] == eos and len(expected) < 60
    target = load_model(folder, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    result = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(0.0, 10, 40)).generate(prompt, 60)
    assert result.token_ids == expected and result.stop_reason == "eos"
    last = result.stats.trajectory[-1]
    assert last.drafted > _emitted_in_last_round(result)  # EOS arrived while draft tokens remained


@pytest.mark.parametrize("max_new", [1, 2, 13, 37])
def test_max_new_tokens_cuts_a_long_draft(trained_pair, max_new):
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    prompt = list(range(3, 8))
    result = SpeculativeEngine(target, make_drafter(target, drafter), Fixed(30)).generate(prompt, max_new)
    assert result.token_ids == hf_greedy(target_dir, prompt, max_new)
    assert result.stats.tokens == max_new and result.stop_reason == "length"


@dataclass(frozen=True)
class VerifyTwo(Fixed):
    """Drafts k tokens but verifies at most two of them."""

    def verify_count(self, confidences: list[float]) -> int:
        return min(2, len(confidences))


def test_only_the_prefix_the_policy_picks_is_verified(trained_pair):
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    prompt = list(range(3, 8))
    result = SpeculativeEngine(target, make_drafter(target, drafter), VerifyTwo(8)).generate(prompt, 40)
    assert result.token_ids == hf_greedy(target_dir, prompt, 40)
    assert max(r.drafted for r in result.stats.trajectory) == 2
    assert result.stats.tokens_per_round > 2.5  # the counting pair accepts both and the target adds one
