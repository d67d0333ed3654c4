"""Training an EAGLE-3 drafter on the target's own outputs with training-time test
(docs/design.md, "EAGLE-3").

Each step runs the frozen target once over a batch of self-distillation rows to get its
features, then unrolls the drafter's chain `TTT_STEPS` times over every slot (`Eagle3Model
.unrolled`): step s feeds the drafter its own step-(s-1) outputs, exactly as drafting does,
so it learns to continue a chain it started rather than only to read true features. Step
s's prediction is the (s+1)-th drafted token of a round: weighted exp(-s/gamma), like
DFlash's k-th masked token, and counted only where that token was written by the target.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from failfast.errors import FailfastError
from failfast.model import ModelConfig, Transformer
from failfast.model.eagle3 import Eagle3Model
from failfast.train.feature_drafters import (DEFAULT_DECAY_GAMMA, FeatureTraining, continued, default_target_layers,
                                             drafter_config, initialised, weighted_cross_entropy)
from failfast.train.loop import TrainSettings

TTT_STEPS = 4  # chain steps unrolled per training step (EAGLE-3 unrolls 7 on GPUs; each costs a layer and a head here)


def new_eagle3(target: ModelConfig, target_layer_ids: tuple[int, ...], seed: int) -> Eagle3Model:
    """A fresh EAGLE-3 drafter for `target`: one Qwen3-style layer of the target's width."""
    cfg = drafter_config(target, 1, target_layer_ids, eagle3=True)
    torch.manual_seed(seed)
    return initialised(Eagle3Model(cfg), 1)


def eagle3_loss(model: Eagle3Model, target: Transformer, tokens: Tensor, first_anchor: int,
                decay_gamma: float = DEFAULT_DECAY_GAMMA, steps: int = TTT_STEPS, vocab: Tensor | None = None,
                soft_labels: bool = False) -> Tensor:
    """Weighted cross-entropy of every unrolled step's predictions against the rows' tokens
    (the target's own continuations), given the target's features; with `soft_labels`
    against the target's next-token distributions there (`weighted_cross_entropy`)."""
    length = tokens.shape[1]
    if length < steps + 2:
        raise FailfastError(f"rows of {length} tokens are too short for {steps} chain steps")
    with torch.no_grad():
        final, features = target.tapped(tokens, model.config.target_layer_ids)
    outputs = model.unrolled(tokens, model.fuse(features), steps)
    slot = torch.arange(length - 2, device=tokens.device)  # slot j predicts token j + 2
    hidden, labels, weights, teacher = [], [], [], []
    for s, out in enumerate(outputs):
        use = (slot >= s) & (slot + 2 >= first_anchor)  # a chain of s steps before it; a target-written label
        hidden.append(model.logits_input(out[:, :length - 2][:, use]).flatten(0, 1))
        labels.append(tokens[:, 2:][:, use].flatten())
        weights.append(torch.full(labels[-1].shape, math.exp(-s / decay_gamma), device=tokens.device))
        if soft_labels:  # the target's output before token j + 2 (a copy per step: only when used)
            teacher.append(final[:, 1:length - 1][:, use].flatten(0, 1))
    return weighted_cross_entropy(torch.cat(hidden), target.lm_head, torch.cat(labels), torch.cat(weights), vocab,
                                  torch.cat(teacher) if soft_labels else None)


def train_eagle3(target_dir: Path, data_dir: Path, rows: Path, out: Path, settings: TrainSettings, *,
                 target_layer_ids: tuple[int, ...] | None = None, decay_gamma: float = DEFAULT_DECAY_GAMMA,
                 init: Path | None = None, draft_vocab_size: int | None = None, soft_labels: bool = False,
                 resume: bool = False, resume_from: Path | None = None) -> dict:
    """Train an EAGLE-3 drafter for the target in `target_dir` on its self-distillation `rows`:
    a new one, or the drafter in `init` continued. With `draft_vocab_size` (below the
    vocabulary size) the loss covers only the draft vocabulary it will draft from."""
    if decay_gamma <= 0:
        raise FailfastError(f"need decay gamma > 0, got {decay_gamma}")
    job = FeatureTraining.load(target_dir, data_dir, rows, out, draft_vocab_size)
    target = job.target.config
    if init is not None:
        model = continued(Path(init), target, "EAGLE-3", lambda c: c.is_eagle3,
                          {"target_layer_ids": target_layer_ids and tuple(sorted(target_layer_ids))})
    else:
        model = new_eagle3(target, target_layer_ids or default_target_layers(target.num_hidden_layers), settings.seed)
    loss = lambda m, batch, gen: eagle3_loss(m, job.target.model, batch, job.first_anchor, decay_gamma,  # noqa: E731
                                             vocab=job.vocab, soft_labels=soft_labels)
    return job.run(model, loss, rows, out, settings, "EAGLE-3 drafter",
                   {"decay_gamma": decay_gamma, "ttt_steps": TTT_STEPS, "soft_labels": soft_labels}, resume, resume_from)
