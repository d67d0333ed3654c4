"""Training losses: next-token (AR) and block diffusion (Fast-dLLM v2 recipe; docs/design.md, "Training")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from failfast.model import Transformer
from failfast.model.transformer import attention_mask


def _causal_logits(model: Transformer, tokens: Tensor) -> Tensor:
    """Logits [B, T-1, V]: position j's output predicts token j+1."""
    pos = torch.arange(tokens.shape[1] - 1, device=tokens.device)
    return model.lm_head(model.hidden_masked(tokens[:, :-1], pos, attention_mask(pos, pos, None)))


@torch.no_grad()
def teacher_probs(teacher: Transformer, tokens: Tensor) -> Tensor:
    """The teacher's next-token distributions [B, T-1, V] for tokens 1..T-1 of a batch.

    Distilling a drafter from the target teaches it what verification checks: the
    target's own prediction at every position, not just the corpus token.
    """
    return _causal_logits(teacher, tokens).float().softmax(-1)


def ar_loss(model: Transformer, tokens: Tensor, generator: torch.Generator | None = None,
            teacher: Transformer | None = None) -> Tensor:
    """Mean next-token cross-entropy over a batch [B, T]; against the teacher's
    distributions when one is given (`generator` unused: same signature as block diffusion)."""
    logits = _causal_logits(model, tokens).float()
    labels = tokens[:, 1:] if teacher is None else teacher_probs(teacher, tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def block_diffusion_layout_mask(length: int, block_size: int, device: torch.device | str = "cpu") -> Tensor:
    """[2L, 2L] mask for the layout [noisy copy | clean copy] of one sequence.

    Noisy tokens of block b see the noisy tokens of b and clean tokens of blocks < b;
    clean tokens see clean tokens block-causally; nothing sees noisy tokens of other blocks.
    """
    blk = torch.arange(length, device=device) // block_size
    same = blk[:, None] == blk[None, :]
    before = blk[None, :] < blk[:, None]
    block_causal = blk[None, :] <= blk[:, None]
    top = torch.cat([same, before], dim=1)
    bottom = torch.cat([torch.zeros_like(same), block_causal], dim=1)
    return torch.cat([top, bottom], dim=0)


def block_masks(batch: int, length: int, block_size: int, generator: torch.Generator | None = None,
                device: torch.device | str = "cpu", suffix_share: float = 0.0) -> Tensor:
    """Bool [B, L] mask: each block draws a mask ratio in (0, 1) and masks that share.

    With probability `suffix_share` a block instead masks everything from a uniform cut to
    its end: the pattern a drafter meets (known tokens, then masks to the block's end), which
    uniform masking seldom produces except as a fully masked block. Position 0 is never masked: it has no previous
    position to predict it from.
    """
    n_blocks = -(-length // block_size)

    def per_block(values: Tensor) -> Tensor:
        return values.repeat_interleave(block_size, dim=1)[:, :length]

    masked = torch.rand(batch, length, generator=generator) < per_block(torch.rand(batch, n_blocks, generator=generator))
    if suffix_share > 0:
        cut = per_block(torch.randint(0, block_size, (batch, n_blocks), generator=generator))
        suffix = per_block(torch.rand(batch, n_blocks, generator=generator) < suffix_share)
        masked = torch.where(suffix, torch.arange(length) % block_size >= cut, masked)
    masked[:, 0] = False
    return masked.to(device)


def masked_rank_in_block(masks: Tensor, block_size: int) -> Tensor:
    """For each position of [N, L] masks, how many masked positions of its block lie at or
    before it: 1 for a block's first masked position (its first drafted token), 2 for the next."""
    n, length = masks.shape
    pad = -length % block_size
    padded = torch.nn.functional.pad(masks.long(), (0, pad)).view(n, -1, block_size)
    return padded.cumsum(-1).view(n, -1)[:, :length]


def block_diffusion_loss(model: Transformer, tokens: Tensor, block_size: int, mask_token_id: int,
                         generator: torch.Generator | None = None, teacher: Transformer | None = None,
                         suffix_share: float = 0.0, decay_gamma: float | None = None) -> Tensor:
    """Cross-entropy on masked positions, each sequence trained with a mask and its complement.

    The prediction for position j is read at j - 1 (token shift): from the noisy copy
    inside a block, from the clean copy for a block's first token (as at inference, where
    it comes from the previous block's committed pass). With a teacher, each masked
    position learns the teacher's next-token distribution instead of the corpus token.
    `decay_gamma` weights the k-th masked position of a block by exp(-(k-1)/gamma) (as DFlash
    recipes do): a draft is only worth its accepted prefix, so early tokens matter most.
    """
    b, length = tokens.shape
    m = block_masks(b, length, block_size, generator, tokens.device, suffix_share)
    complement = ~m
    complement[:, 0] = False
    masks = torch.cat([m, complement], dim=0)          # [2B, L]
    clean = tokens.repeat(2, 1)                        # [2B, L]
    noisy = clean.masked_fill(masks, mask_token_id)
    pos = torch.arange(length, device=tokens.device)
    hidden = model.hidden_masked(torch.cat([noisy, clean], dim=1), pos.repeat(2),
                                 block_diffusion_layout_mask(length, block_size, tokens.device))
    noisy_out, clean_out = hidden[:, :length], hidden[:, length:]
    # Output at j-1 predicts j; block starts read the clean stream.
    starts = (pos[1:] % block_size == 0)
    shifted = torch.where(starts[None, :, None], clean_out[:, :-1], noisy_out[:, :-1])
    selected = masks[:, 1:]
    logits = model.lm_head(shifted[selected])
    labels = clean[:, 1:] if teacher is None else teacher_probs(teacher, tokens).repeat(2, 1, 1)
    if decay_gamma is None:
        return F.cross_entropy(logits.float(), labels[selected])
    rank = masked_rank_in_block(masks, block_size)[:, 1:][selected]
    weights = torch.exp(-(rank - 1).float() / decay_gamma)
    losses = F.cross_entropy(logits.float(), labels[selected], reduction="none")
    return (weights * losses).sum() / weights.sum()


def causal_window_layout(length: int, anchors: Tensor, masks: int) -> tuple[Tensor, Tensor]:
    """Positions [T] and the [T, T] attention mask of [a sequence | `masks` windows of masks].

    The sequence's tokens attend causally. Each anchor a (a position of the sequence) gets a
    window of masks at positions a+1 .. a+masks, laid out depth by depth after the sequence;
    the window's d-th mask sees the sequence up to a and its window's masks 1..d: what a
    causal-window pass over [known tokens up to a, masks] computes at inference
    (drafters/causal_window.py), for every anchor in one forward.
    """
    count = anchors.numel()
    positions = torch.cat([torch.arange(length)] + [anchors + d for d in range(1, masks + 1)])
    total = length + masks * count
    allowed = torch.zeros(total, total, dtype=torch.bool)
    allowed[:length, :length] = torch.ones(length, length, dtype=torch.bool).tril()
    known = torch.arange(length)[None, :] <= anchors[:, None]  # [anchors, length]
    window = torch.arange(count)
    for d in range(1, masks + 1):
        rows = length + (d - 1) * count + window
        allowed[rows, :length] = known
        for e in range(1, d + 1):
            allowed[rows, length + (e - 1) * count + window] = True
    return positions, allowed


def causal_window_loss(model: Transformer, tokens: Tensor, mask_token_id: int, generator: torch.Generator | None = None,
                       masks: int = 3, anchor_share: int = 4) -> Tensor:
    """Cross-entropy of causal-window drafting (docs/design.md, "Causal windows"): every
    position's next token from the causal sequence (a window's first draft token, read at its
    last known token, is an AR prediction), and, behind `length // anchor_share` random
    anchors, the tokens after the next from a window of `masks` masks (the d-th mask predicts
    the token at anchor + d + 1). Every prediction weighs the same."""
    b, length = tokens.shape
    anchors = torch.randperm(length - 1 - masks, generator=generator)[:length // anchor_share].sort().values
    positions, allowed = causal_window_layout(length, anchors, masks)
    filled = torch.full((b, masks * anchors.numel()), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    hidden = model.hidden_masked(torch.cat([tokens, filled], dim=1), positions.to(tokens.device),
                                 allowed.to(tokens.device))
    next_logits = model.lm_head(hidden[:, :length - 1])
    next_loss = F.cross_entropy(next_logits.float().flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    labels = torch.cat([tokens[:, anchors + d + 1] for d in range(1, masks + 1)], dim=1)  # depth by depth, as laid out
    window_logits = model.lm_head(hidden[:, length:])
    window_loss = F.cross_entropy(window_logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    return (next_loss + window_loss) / (b * (length - 1) + labels.numel())
