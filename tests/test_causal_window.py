"""Causal windows (drafters/causal_window.py), float64 on CPU: drafts are the causal forward
of [known tokens, masks], the drafter's cache holds exactly the known tokens' causal K/V
across rounds, training lays out what a pass computes, and the mode comes from the
checkpoint unless asked for. Losslessness and batching: test_lossless.py, test_batching.py."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from failfast import FailFast, SpeculativeEngine, load_model, make_drafter
from failfast.drafters.block_diffusion import BlockDiffusionDrafter
from failfast.drafters.causal_window import CausalWindowDrafter
from failfast.errors import CheckpointError, PolicyError
from failfast.model.transformer import attention_mask
from failfast.train.objectives import causal_window_layout, causal_window_loss
from tests.helpers import copy_checkpoint, prompt_of


def _direct_logits(model, known: list[int], masks: int, mask_id: int) -> torch.Tensor:
    """Cache-free causal forward of [known, masks]: logits at the last known token and at each mask."""
    tokens = torch.tensor([known + [mask_id] * masks])
    positions = torch.arange(tokens.shape[1])
    hidden = model.hidden_masked(tokens, positions, attention_mask(positions, positions, None))
    return model.lm_head(hidden[0, len(known) - 1:])


def _greedy(logits: torch.Tensor, limit: int, banned: int) -> list[int]:
    logits = logits[:, :limit].clone()
    logits[:, banned] = float("-inf")
    return logits.argmax(-1).tolist()


def _causal_drafter(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    loaded = load_model(random_models["random-dllm"], dtype=torch.float64)
    drafter = make_drafter(target, loaded, denoise="causal")
    assert isinstance(drafter, CausalWindowDrafter)
    return drafter, loaded


def test_drafts_are_the_causal_forward_of_known_tokens_and_masks(random_models):
    drafter, loaded = _causal_drafter(random_models)
    model, mask, limit = loaded.model, loaded.config.mask_token_id, drafter.vocab_limit
    committed = prompt_of(9)
    drafter.prepare(60)
    drafter.begin(committed)
    first, confs = drafter.draft(4)
    assert first == _greedy(_direct_logits(model, committed, 3, mask), limit, mask)
    assert len(confs) == 4 and all(0 < c <= 1 for c in confs)
    # a draft that goes on feeds what it drafted as known tokens
    more, _ = drafter.draft(3)
    assert more == _greedy(_direct_logits(model, committed + first, 2, mask), limit, mask)
    # the next round keeps the verified prefix and feeds the rest
    committed = committed + first[:2] + [7]
    drafter.begin(committed)
    again, _ = drafter.draft(5)
    assert again == _greedy(_direct_logits(model, committed, 4, mask), limit, mask)
    one, _ = drafter.draft(1)  # no masks: an AR step
    assert one == _greedy(_direct_logits(model, committed + again, 0, mask), limit, mask)


def test_cache_holds_the_known_tokens_causal_keys_and_values(random_models):
    drafter, loaded = _causal_drafter(random_models)
    target = load_model(random_models["target"], dtype=torch.float64)
    SpeculativeEngine(target, drafter, FailFast(tau=0.0, chunk=3, max_draft=20)).generate(prompt_of(7), 30)
    n = drafter.cache.length
    assert n == len(drafter.cache_ids) > 7
    fresh = loaded.model.new_cache(n)
    loaded.model(torch.tensor([drafter.cache_ids]), 0, fresh)
    for layer in range(loaded.config.num_hidden_layers):
        torch.testing.assert_close(drafter.cache.keys[layer][..., :n, :], fresh.keys[layer][..., :n, :],
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(drafter.cache.values[layer][..., :n, :], fresh.values[layer][..., :n, :],
                                   rtol=1e-12, atol=1e-12)


def test_rows_drafted_together_are_each_rows_own_drafts(random_models):
    """`draft_rows` over a shared cache: each row's tokens and confidences are what its drafter
    drafts alone, windows of different sizes, a draft that goes on included."""
    target = load_model(random_models["target"], dtype=torch.float64)
    loaded = load_model(random_models["random-dllm"], dtype=torch.float64)
    prompts, wants = [prompt_of(9), prompt_of(4, seed=1), prompt_of(13, seed=2)], [{0: 4, 1: 3, 2: 1}, {0: 2, 1: 5, 2: 3}]
    alone = []
    for slot, prompt in enumerate(prompts):
        drafter = make_drafter(target, loaded, denoise="causal")
        drafter.prepare(60)
        drafter.begin(prompt)
        alone.append([drafter.draft(want[slot]) for want in wants])
    drafters = [make_drafter(target, loaded, denoise="causal") for _ in prompts]
    shared = loaded.model.new_cache(drafters[0].batch_capacity(60), batch=len(prompts))
    for slot, (drafter, prompt) in enumerate(zip(drafters, prompts)):
        drafter.prepare(60, cache=shared.row(slot))
        drafter.begin(prompt)
    for call, want in enumerate(wants):
        together = CausalWindowDrafter.draft_rows(drafters, want, shared)
        for slot in want:
            tokens, confs = together[slot]
            assert tokens == alone[slot][call][0], (call, slot)
            torch.testing.assert_close(torch.tensor(confs), torch.tensor(alone[slot][call][1]), rtol=1e-9, atol=1e-12)


def test_training_layout_is_what_a_pass_computes(random_models):
    loaded = load_model(random_models["random-dllm"], dtype=torch.float64)
    model, mask = loaded.model, loaded.config.mask_token_id
    sequence = prompt_of(20)
    anchors, masks = torch.tensor([0, 5, 11, 16]), 3
    positions, allowed = causal_window_layout(len(sequence), anchors, masks)
    tokens = torch.tensor([sequence + [mask] * (masks * len(anchors))])
    logits = model.lm_head(model.hidden_masked(tokens, positions, allowed)[0])
    for g, a in enumerate(anchors.tolist()):
        rows = [a] + [len(sequence) + (d - 1) * len(anchors) + g for d in range(1, masks + 1)]
        torch.testing.assert_close(logits[rows], _direct_logits(model, sequence[:a + 1], masks, mask),
                                   rtol=1e-10, atol=1e-10)
    # the loss: the mean cross-entropy of every next-token and every window prediction, behind
    # the anchors its generator draws
    loss = causal_window_loss(model, torch.tensor([sequence]), mask, torch.Generator().manual_seed(0), masks, 5)
    drawn = torch.randperm(len(sequence) - 1 - masks, generator=torch.Generator().manual_seed(0))[:4].sort().values
    terms = [F.cross_entropy(_direct_logits(model, sequence[:j + 1], 0, mask), torch.tensor([sequence[j + 1]]))
             for j in range(len(sequence) - 1)]
    for a in drawn.tolist():
        window = _direct_logits(model, sequence[:a + 1], masks, mask)[1:]
        terms += [F.cross_entropy(window[d - 1:d], torch.tensor([sequence[a + d + 1]])) for d in range(1, masks + 1)]
    torch.testing.assert_close(loss.double(), torch.stack(terms).mean(), rtol=1e-6, atol=1e-6)  # losses in float32


def test_the_mode_comes_from_the_checkpoint_unless_asked_for(random_models, tmp_path):
    target = load_model(random_models["target"], dtype=torch.float64)
    plain = load_model(random_models["random-dllm"], dtype=torch.float64)
    folder = copy_checkpoint(random_models["random-dllm"], tmp_path / "causal-dllm")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "failfast_denoise": "causal"}))
    trained = load_model(folder, dtype=torch.float64)
    assert trained.config.to_dict()["failfast_denoise"] == "causal" and "failfast_denoise" not in plain.config.to_dict()
    assert isinstance(make_drafter(target, trained), CausalWindowDrafter)
    assert isinstance(make_drafter(target, trained, denoise="sliding"), BlockDiffusionDrafter)
    assert isinstance(make_drafter(target, plain), BlockDiffusionDrafter)
    for options in (dict(sub_block_size=4), dict(unmask_threshold=0.5)):
        with pytest.raises(PolicyError, match="block modes"):
            make_drafter(target, trained, **options)
    with pytest.raises(PolicyError, match="denoising pass must be one of"):
        make_drafter(target, plain, denoise="diagonal")
    (folder / "config.json").write_text(json.dumps({**config, "failfast_denoise": "Causal"}))
    with pytest.raises(CheckpointError, match="config.json"):
        make_drafter(target, load_model(folder, dtype=torch.float64))
