"""Block-diffusion specifics: attention masks, token shift, K/V reuse equals recomputation."""

from __future__ import annotations

import pytest
import torch

from failfast import BlockDiffusionDrafter, load_model
from failfast.drafters.block_diffusion import DENOISE_MODES
from failfast.model.transformer import attention_mask
from failfast.train.objectives import block_diffusion_layout_mask
from tests.helpers import tiny_config, write_model

B, S, MASK = 8, 4, 95
WANT = 3  # draft tokens asked for at once: a sliding window's size


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
    """Logits predicting position len(committed), computed from scratch by the definition: the
    block's known tokens and masks (in prefix mode only through the active sub-block's end, in
    sliding mode through the end of the WANT-token window asked for from that position)."""
    model, n = d.model, len(committed)
    full = n // B * B
    cache = model.new_cache(200)
    if n == full:
        return model(torch.tensor([committed]), 0, cache, block_size=B)[0, -1]
    if full:
        model(torch.tensor([committed[:full]]), 0, cache, block_size=B)
    block = committed[full:] + [MASK] * (full + B - n)
    if d.denoise == "prefix":
        block = block[:(n - full) // S * S + S]
    elif d.denoise == "sliding":
        block = block[:n - full + WANT]
    logits = model(torch.tensor([block]), full, cache, block_size=B, commit=False)
    return logits[0, n - full - 1]  # token shift: position n is read at n - 1


@pytest.mark.parametrize("denoise", DENOISE_MODES)
@pytest.mark.parametrize("n", [3, 8, 11, 16, 21])
def test_first_draft_token_uses_the_token_shift(drafter, n, denoise):
    drafter.denoise = denoise
    drafter.unmask_threshold = 0.0  # one pass decides the whole window, from the definition's masks
    committed = torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    drafter.begin(committed)
    tokens, confs = drafter.draft(WANT)
    token, conf = tokens[0], confs[0]
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


def _scratch_pass_setup(tmp_path, layers: int):
    """A model with two committed blocks and a full-block scratch pass over a third."""
    cfg = tiny_config(num_hidden_layers=layers, mask_token_id=MASK, block_size=B, sub_block_size=S)
    model = load_model(write_model(tmp_path / f"m{layers}", cfg, seed=11), dtype=torch.float64).model
    gen = torch.Generator().manual_seed(layers)
    prefix = torch.randint(2, 90, (1, 2 * B), generator=gen)
    block = torch.randint(2, 90, (1, B), generator=gen)
    cache = model.new_cache(64)
    model(prefix, 0, cache, block_size=B)
    full = model(block, 2 * B, cache, block_size=B, commit=False)
    return model, cache, block, full


@pytest.mark.parametrize("lo,hi", [(0, B), (2, 6), (3, B), (5, 6)])
def test_sub_block_pass_over_unchanged_tokens_equals_the_full_block_pass(tmp_path, lo, hi):
    model, cache, block, full = _scratch_pass_setup(tmp_path, layers=3)
    part = model(block[:, lo:hi], 2 * B + lo, cache, block_size=B, commit=False, context_end=3 * B)
    torch.testing.assert_close(part, full[:, lo:hi], rtol=1e-12, atol=1e-12)
    assert cache.length == 2 * B  # scratch passes never extend the cache


@pytest.mark.parametrize("lo,hi", [(0, 4), (2, 6), (3, B), (5, 6)])
def test_prefix_pass_over_unchanged_tokens_equals_the_pass_over_the_blocks_prefix(tmp_path, lo, hi):
    # prefix mode's definition: the block's first `hi` positions, attending to nothing after them
    model, cache, block, _ = _scratch_pass_setup(tmp_path, layers=3)
    prefix_pass = model(block[:, :hi], 2 * B, cache, block_size=B, commit=False)
    part = model(block[:, lo:hi], 2 * B + lo, cache, block_size=B, commit=False, context_end=2 * B + hi)
    torch.testing.assert_close(part, prefix_pass[:, lo:hi], rtol=1e-12, atol=1e-12)
    assert cache.length == 2 * B


def test_sub_block_pass_reads_other_positions_kv_from_scratch(tmp_path):
    # With one layer, K/V depend only on each position's own token, so recomputing the changed
    # positions and reading the others' scratch K/V must equal a full pass over the new block.
    model, cache, block, _ = _scratch_pass_setup(tmp_path, layers=1)
    changed = block.clone()
    changed[0, 3:6] = torch.tensor([7, 8, 9])
    part = model(changed[:, 3:6], 2 * B + 3, cache, block_size=B, commit=False, context_end=3 * B)
    reference = model.new_cache(64)
    model(torch.cat([cache_prefix(cache, model), changed], dim=1)[:, :2 * B], 0, reference, block_size=B)
    want = model(changed, 2 * B, reference, block_size=B, commit=False)[:, 3:6]
    torch.testing.assert_close(part, want, rtol=1e-12, atol=1e-12)


def cache_prefix(cache, model) -> torch.Tensor:
    """The prefix tokens of `_scratch_pass_setup` (same generator), for a fresh reference cache."""
    gen = torch.Generator().manual_seed(model.config.num_hidden_layers)
    return torch.randint(2, 90, (1, 2 * B), generator=gen)


def test_scratch_pass_rejects_a_start_below_the_cache(tmp_path):
    model, cache, block, _ = _scratch_pass_setup(tmp_path, layers=1)
    with pytest.raises(ValueError, match="cache holds"):
        model(block[:, :2], B, cache, block_size=B, commit=False, context_end=3 * B)
    with pytest.raises(ValueError, match="cache holds"):
        model(block[:, 2:4], 2 * B + 2, cache, block_size=B)  # a committing pass must start at the cache end


class _WidthRecorder:
    """Wraps a model to record how many tokens each forward pass computes."""

    def __init__(self, model):
        self.model, self.widths = model, []

    def __call__(self, tokens, *args, **kwargs):
        self.widths.append(tokens.shape[1])
        return self.model(tokens, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("denoise", DENOISE_MODES)
def test_sub_block_mode_computes_only_the_active_positions(tmp_path, denoise):
    folder = write_model(tmp_path / "d", tiny_config(mask_token_id=MASK, block_size=B, sub_block_size=S), seed=4)
    d = BlockDiffusionDrafter(load_model(folder, dtype=torch.float64), vocab_limit=96, unmask_threshold=0.0,
                              denoise=denoise)
    d.prepare(100)
    d.model = recorder = _WidthRecorder(d.model)
    d.begin([5, 6, 7])          # block 0: 3 known tokens, masks at 3..7 (sub-blocks [0,4) and [4,8))
    d.draft(5 + 4)              # threshold 0: one pass per sub-block; then block 1's first sub-block
    if denoise == "full-block":
        assert recorder.widths == [B, B, B, B]
    elif denoise == "sliding":
        # one pass per request, of the tokens asked for: [0,8) drafts 3..7, attending to nothing
        # after it; [0,8) commits block 0; block 1's first 4 tokens: the boundary's and [0,4)
        assert recorder.widths == [B, B, S]
        d.draft(2)              # the window 4..5 after positions 1..3, which changed
        assert recorder.widths[-1] == 6 - 1
        block_1 = d.block[:]
        d.begin(d.cache_ids + block_1[:4])  # the next round accepts 3 tokens of block 1
        d.draft(2)                          # scratch K/V valid up to 3, whose output predicts 4: 3..5
        assert recorder.widths[-1] == 6 - 3
    elif denoise == "prefix":
        # [0,4): the first sub-block, attending to nothing after it; [3,8): position 3 was a mask
        # when its scratch K/V were written; [0,8) commits block 0; [0,4): block 1's first sub-block
        assert recorder.widths == [S, B - 3, B, S]
        d.draft(4)              # block 1's second sub-block: positions 1..3 changed, 4..7 active
        assert recorder.widths[-1] == B - 1
        block_1 = d.block[:]
        d.begin(d.cache_ids + block_1[:5])  # the next round accepts 4 tokens of block 1
        d.draft(3)                          # its scratch K/V stay valid: only positions 4..7 again
        assert recorder.widths[-1] == B - 4
    else:
        # [0,8): the first pass fills the scratch K/V; [3,8): position 3 was just unmasked and
        # positions 4..7 are the active sub-block; [0,8) commits block 0; [0,8): block 1's first pass
        assert recorder.widths == [B, B - 3, B, B]
        d.draft(4)              # block 1's second sub-block: positions 1..3 changed, 4..7 active
        assert recorder.widths[-1] == B - 1
