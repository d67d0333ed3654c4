"""Training a DFlash drafter on the target's own outputs (docs/design.md,
"Target-conditioned drafting").

Each step runs the frozen target once over a batch of self-distillation rows to get its
features, then trains the drafter on windows anchored at random positions: context = the
target's features before the anchor, window = the anchor's token (and, for an extension
window, the blocks after it) known, one block masked. The layout matches drafting exactly:
a round's first pass (`[token, block_size - 1 masks]`) and its extension passes
(`[token, j * block_size - 1 known tokens, block_size masks]`). The loss at the k-th masked
position is weighted by exp(-(k-1)/gamma): a draft is worth only its accepted prefix.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from failfast.errors import FailfastError
from failfast.model import ModelConfig, Transformer
from failfast.model.dflash import DFlashModel
from failfast.train.feature_drafters import (DEFAULT_DECAY_GAMMA, FeatureTraining, continued, default_target_layers,
                                             drafter_config, initialised, weighted_cross_entropy)
from failfast.train.loop import TrainSettings

# Windows per row and step, by pass index (0: a round's first pass, j: its j-th extension).
# First passes dominate, as in drafting, where every round runs one and few run extensions.
# The target's forward over the rows is a fixed cost per step, so many windows share it: 12
# first-pass windows give 3x the first-pass examples of 4 for 1.2x the step time (1 thread,
# bf16 autocast, draft-vocabulary head).
WINDOW_PASSES = (0,) * 12 + (1, 2)


def window_shape(pass_index: int, block_size: int) -> tuple[int, int]:
    """(window length, known tokens at its start) of a drafting pass."""
    if pass_index == 0:
        return block_size, 1
    return (pass_index + 1) * block_size, pass_index * block_size


def new_dflash(target: ModelConfig, layers: int, target_layer_ids: tuple[int, ...], block_size: int,
               mask_token_id: int, seed: int) -> DFlashModel:
    """A fresh DFlash drafter for `target`: Qwen3 layers of the target's width and heads."""
    cfg = drafter_config(target, layers, target_layer_ids, mask_token_id=mask_token_id, block_size=block_size)
    torch.manual_seed(seed)
    return initialised(DFlashModel(cfg), layers)


def anchor_windows(batch: int, length: int, block_size: int, first_anchor: int, generator: torch.Generator,
                   passes: tuple[int, ...] = WINDOW_PASSES) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """For every row, one window per entry of `passes`, Q positions in all: positions [B, Q],
    each position's window anchor [B, Q], window index [Q], and rank [Q] (k for the k-th
    masked position of its window, 0 for a known one)."""
    positions, anchors, window_of, rank = [], [], [], []
    for w, j in enumerate(passes):
        size, given = window_shape(j, block_size)
        if length - size < first_anchor:
            raise FailfastError(f"rows of {length} tokens have no room for a {size}-token window after position "
                                f"{first_anchor}")
        anchor = torch.randint(first_anchor, length - size + 1, (batch, 1), generator=generator)
        positions.append(anchor + torch.arange(size))
        anchors.append(anchor.expand(batch, size))
        window_of.append(torch.full((size,), w))
        rank.append((torch.arange(size) - given + 1).clamp(min=0))
    return torch.cat(positions, 1), torch.cat(anchors, 1), torch.cat(window_of), torch.cat(rank)


def dflash_loss(model: DFlashModel, target: Transformer, tokens: Tensor, generator: torch.Generator,
                first_anchor: int, decay_gamma: float = DEFAULT_DECAY_GAMMA,
                passes: tuple[int, ...] = WINDOW_PASSES, vocab: Tensor | None = None,
                soft_labels: bool = False) -> Tensor:
    """Position-decayed cross-entropy of the drafter's masked window positions against the
    rows' tokens (the target's own continuations), given the target's features. With `vocab`
    (sorted token ids: the draft vocabulary) the head covers only those rows, as in drafting,
    and tokens outside it carry no loss. With `soft_labels` the labels are the target's
    next-token distributions at those positions instead (`weighted_cross_entropy`)."""
    cfg = model.config
    b, length = tokens.shape
    device = tokens.device
    with torch.no_grad():
        final, features = target.tapped(tokens, cfg.target_layer_ids)
    positions, anchors, window_of, rank = (t.to(device) for t in
                                           anchor_windows(b, length, cfg.block_size, first_anchor, generator, passes))
    window_tokens = tokens.gather(1, positions)
    masked = rank > 0
    inputs = torch.where(masked, cfg.mask_token_id, window_tokens)
    context = model.context_kv(model.fuse(features), torch.arange(length, device=device))
    # a window's queries see the target features before its anchor and their own window only
    sees_context = torch.arange(length, device=device)[None, None, :] < anchors[:, :, None]
    same_window = (window_of[:, None] == window_of[None, :]).expand(b, -1, -1)
    hidden = model.hidden(inputs, positions, context, torch.cat([sees_context, same_window], dim=2)[:, None])
    weights = torch.exp(-(rank[masked] - 1).float() / decay_gamma).expand(b, -1).flatten()
    teacher = final.gather(1, (positions[:, masked] - 1)[..., None].expand(-1, -1, final.shape[-1])) if soft_labels else None
    return weighted_cross_entropy(hidden[:, masked].flatten(0, 1), target.lm_head, window_tokens[:, masked].flatten(),
                                  weights, vocab, None if teacher is None else teacher.flatten(0, 1))


def train_dflash(target_dir: Path, data_dir: Path, rows: Path, out: Path, settings: TrainSettings, *,
                 layers: int = 2, target_layer_ids: tuple[int, ...] | None = None, block_size: int | None = None,
                 decay_gamma: float = DEFAULT_DECAY_GAMMA, init: Path | None = None, draft_vocab_size: int | None = None,
                 soft_labels: bool = False, resume: bool = False, resume_from: Path | None = None) -> dict:
    """Train a DFlash drafter for the target in `target_dir` on its self-distillation `rows`
    (windows anchored in the target-written part of each row): a new one (blocks of 16 unless
    `block_size` says otherwise), or the drafter in `init` continued. With `draft_vocab_size`
    (below the vocabulary size) the loss covers only the draft vocabulary it will draft from
    (written into `out`)."""
    if (block_size is not None and block_size < 2) or decay_gamma <= 0 or layers < 1:
        raise FailfastError(f"need block size >= 2, decay gamma > 0 and >= 1 layer, got {block_size}, "
                            f"{decay_gamma} and {layers}")
    job = FeatureTraining.load(target_dir, data_dir, rows, out, draft_vocab_size)
    target = job.target.config
    if init is not None:
        model = continued(Path(init), target, "DFlash", lambda c: c.is_dflash,
                          {"target_layer_ids": target_layer_ids and tuple(sorted(target_layer_ids)),
                           "block_size": block_size})
    else:
        layer_ids = target_layer_ids or default_target_layers(target.num_hidden_layers)
        model = new_dflash(target, layers, layer_ids, block_size or 16, job.mask_id, settings.seed)
    loss = lambda m, batch, gen: dflash_loss(m, job.target.model, batch, gen, job.first_anchor, decay_gamma,  # noqa: E731
                                             vocab=job.vocab, soft_labels=soft_labels)
    return job.run(model, loss, rows, out, settings, "DFlash drafter",
                   {"decay_gamma": decay_gamma, "window_passes": list(WINDOW_PASSES), "soft_labels": soft_labels},
                   resume, resume_from)
