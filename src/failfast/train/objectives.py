"""Training losses: next-token (AR) and block diffusion (Fast-dLLM v2 recipe, DESIGN.md 10)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from failfast.model import Transformer
from failfast.model.transformer import attention_mask


def ar_loss(model: Transformer, tokens: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Mean next-token cross-entropy over a batch [B, T] (`generator` unused: same signature as block diffusion)."""
    t = tokens.shape[1]
    pos = torch.arange(t, device=tokens.device)
    hidden = model.hidden_masked(tokens[:, :-1], pos[:-1], attention_mask(pos[:-1], pos[:-1], None))
    logits = model.lm_head(hidden)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


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
                device: torch.device | str = "cpu") -> Tensor:
    """Bool [B, L] mask: each block draws a mask ratio in (0, 1) and masks that share.

    Position 0 is never masked: it has no previous position to predict it from.
    """
    n_blocks = -(-length // block_size)
    ratio = torch.rand(batch, n_blocks, generator=generator).repeat_interleave(block_size, dim=1)[:, :length]
    masked = torch.rand(batch, length, generator=generator) < ratio
    masked[:, 0] = False
    return masked.to(device)


def block_diffusion_loss(model: Transformer, tokens: Tensor, block_size: int, mask_token_id: int,
                         generator: torch.Generator | None = None) -> Tensor:
    """Cross-entropy on masked positions, each sequence trained with a mask and its complement.

    The prediction for position j is read at j - 1 (token shift): from the noisy copy
    inside a block, from the clean copy for a block's first token (as at inference, where
    it comes from the previous block's committed pass).
    """
    b, length = tokens.shape
    m = block_masks(b, length, block_size, generator, tokens.device)
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
    return F.cross_entropy(logits.float(), clean[:, 1:][selected])
