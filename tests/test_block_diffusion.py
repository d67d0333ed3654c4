"""Block-diffusion specifics: attention masks, token shift, K/V reuse equals recomputation."""

from __future__ import annotations

import pytest
import torch

from failfast import BlockDiffusionDrafter, load_model
from failfast.model.transformer import attention_mask
from failfast.train.objectives import block_diffusion_layout_mask
from tests.helpers import tiny_config, write_model

B, S, MASK = 8, 4, 95


@pytest.fixture
def drafter(tmp_path) -> BlockDiffusionDrafter:
    folder = write_model(tmp_path / "dllm", tiny_config(mask_token_id=MASK, block_size=B, sub_block_size=S), seed=4)
    d = BlockDiffusionDrafter(load_model(folder, dtype=torch.float64), vocab_limit=96, unmask_threshold=0.05)
    d.prepare(200)
    return d


def test_attention_masks_follow_their_definitions():
    q, k = torch.arange(5, 29), torch.arange(0, 29)
    block = attention_mask(q, k, B)
    causal = attention_mask(q, k, None)
    for i, qp in enumerate(q.tolist()):
        for j, kp in enumerate(k.tolist()):
            assert bool(block[i, j]) == (qp // B >= kp // B)
            assert bool(causal[i, j]) == (kp <= qp)


def test_training_layout_mask():
    length = 20
    m = block_diffusion_layout_mask(length, B)
    blk = lambda p: p // B  # noqa: E731
    for qi in range(2 * length):
        for ki in range(2 * length):
            q_noisy, k_noisy = qi < length, ki < length
            qb, kb = blk(qi % length), blk(ki % length)
            if q_noisy:
                want = (kb == qb) if k_noisy else (kb < qb)
            else:
                want = (not k_noisy) and kb <= qb
            assert bool(m[qi, ki]) == want, (qi, ki)


def _reference_logits(d: BlockDiffusionDrafter, committed: list[int]) -> torch.Tensor:
    """Logits predicting position len(committed), computed from scratch by the definition."""
    model, n = d.model, len(committed)
    full = n // B * B
    cache = model.new_cache(200)
    if n == full:
        return model(torch.tensor([committed]), 0, cache, block_size=B)[0, -1]
    if full:
        model(torch.tensor([committed[:full]]), 0, cache, block_size=B)
    block = committed[full:] + [MASK] * (full + B - n)
    logits = model(torch.tensor([block]), full, cache, block_size=B, commit=False)
    return logits[0, n - full - 1]  # token shift: position n is read at n - 1


@pytest.mark.parametrize("n", [3, 8, 11, 16, 21])
def test_first_draft_token_uses_the_token_shift(drafter, n):
    committed = torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    drafter.begin(committed)
    (token,), (conf,) = drafter.draft(1)
    logits = _reference_logits(drafter, committed)[:96].clone()
    logits[MASK] = float("-inf")
    probs = logits.softmax(-1)
    assert token == int(probs.argmax()) and conf == pytest.approx(float(probs.max()))


def _assert_cache_matches_recomputation(d: BlockDiffusionDrafter) -> None:
    length = d.cache.length
    assert length % B == 0 and d.cache_ids[:length] == d.cache_ids
    fresh = d.model.new_cache(200)
    d.model(torch.tensor([d.cache_ids]), 0, fresh, block_size=B)
    for layer in range(len(fresh.keys)):
        torch.testing.assert_close(d.cache.keys[layer][:, :, :length], fresh.keys[layer][:, :, :length],
                                   rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(d.cache.values[layer][:, :, :length], fresh.values[layer][:, :, :length],
                                   rtol=1e-12, atol=1e-12)


def test_verified_blocks_are_reused_and_equal_recomputed_kv(drafter):
    committed = torch.randint(2, 90, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    drafter.begin(committed)
    draft, _ = drafter.draft(20)          # positions 13..32: blocks 1-3 get committed with drafts
    assert drafter.cache.length == 4 * B
    forwards = drafter.forwards
    # Verification accepted 14 drafts and corrected the next: blocks 0-2 hold 24 verified
    # tokens and are kept; block 3 held a rejected guess and is dropped.
    new_committed = committed + draft[:14] + [(draft[14] + 1) % 90]
    drafter.begin(new_committed)
    assert drafter.cache.length == 3 * B and drafter.forwards == forwards  # kept, nothing recomputed
    _assert_cache_matches_recomputation(drafter)
    # A rejection inside block 1 rolls back to block 1 and recomputes only what is verified.
    short = committed + [(draft[0] + 1) % 90]
    drafter.begin(short)
    assert drafter.cache.length == B
    _assert_cache_matches_recomputation(drafter)
    drafter.draft(12)
    _assert_cache_matches_recomputation(drafter)


def test_every_pass_counts_and_unmask_threshold_one_means_one_token_per_pass(tmp_path):
    folder = write_model(tmp_path / "d", tiny_config(mask_token_id=MASK, block_size=B, sub_block_size=S), seed=4)
    d = BlockDiffusionDrafter(load_model(folder, dtype=torch.float64), vocab_limit=96, unmask_threshold=1.0)
    d.prepare(100)
    d.begin([5, 6, 7])         # block 0 holds 3 known tokens; 5 masks remain in it
    tokens, confs = d.draft(5)
    assert len(tokens) == 5 and all(0 < c <= 1 for c in confs)
    assert d.forwards == 5     # threshold 1: only the most confident position per pass
