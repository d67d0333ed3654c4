"""The training recipe: model sizes and the three stages (AR target, AR drafter, AR -> diffusion)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor, nn

from failfast.errors import FailfastError
from failfast.model import ModelConfig, Transformer, load_model
from failfast.train.data import PreparedData
from failfast.train.loop import TrainSettings, train
from failfast.train.objectives import ar_loss, block_diffusion_loss, causal_window_loss
from failfast.train.selfdistill import load_rows
from failfast.train.tokenizer import special_ids

# Shapes chosen by measurement on a 2-core CPU (see the model cards): the target's decode
# step costs several drafter denoising passes, and the whole recipe fits in about 90 min.
SIZES: dict[str, dict[str, int]] = {
    "target": dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                   num_attention_heads=6, num_key_value_heads=2),
    "drafter": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1),
}
CONTEXT = 2048


def new_model(size: str, vocab_size: int, eos_id: int, seed: int) -> Transformer:
    if size not in SIZES:
        raise FailfastError(f"unknown model size {size!r}; choose from {', '.join(SIZES)}")
    cfg = ModelConfig(vocab_size=vocab_size, max_position_embeddings=CONTEXT, tie_word_embeddings=True,
                      rope_theta=10000.0, eos_token_ids=(eos_id,), **SIZES[size])
    torch.manual_seed(seed)
    model = Transformer(cfg)
    out_scale = 0.02 / (2 * cfg.num_hidden_layers) ** 0.5
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = out_scale if name.endswith(("o_proj", "down_proj")) else 0.02
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    return model


def _teacher(path: Path | None, vocab_size: int) -> Transformer | None:
    if path is None:
        return None
    teacher = load_model(path)
    if teacher.config.vocab_size != vocab_size:
        raise FailfastError(f"teacher {path} has vocabulary size {teacher.config.vocab_size}, the corpus "
                            f"tokenizer {vocab_size}")
    return teacher.model


def _trainable(init_dir: Path, vocab_size: int) -> Transformer:
    """An existing checkpoint, in float32 and trainable, as a starting point."""
    loaded = load_model(init_dir)
    if loaded.config.vocab_size != vocab_size:
        raise FailfastError(f"{init_dir} has vocabulary size {loaded.config.vocab_size}, the corpus "
                            f"tokenizer {vocab_size}")
    model = Transformer(loaded.config)
    model.load_state_dict(loaded.model.state_dict())
    return model.requires_grad_(True)


def _reconfigured(base: Transformer, **changes) -> Transformer:
    """`base`'s weights, trainable, in a model of its config with `changes` (a mask token, block
    sizes, a drafting mode)."""
    model = Transformer(replace(base.config, **changes))
    model.load_state_dict(base.state_dict())
    return model.requires_grad_(True)


def _train_stream(data: PreparedData, rows: Path | None) -> Tensor:
    """The corpus stream, or the target's self-distillation rows when given."""
    return data.train if rows is None else load_rows(rows)


def train_ar(data_dir: Path, out: Path, size: str, settings: TrainSettings, *, resume: bool = False,
             teacher: Path | None = None, init: Path | None = None, resume_from: Path | None = None,
             rows: Path | None = None) -> dict:
    """Next-token training on the prepared corpus (or self-distillation `rows`): of a fresh
    model of `size`, or continuing from the checkpoint `init`; against a teacher's
    distributions if one is given."""
    data = PreparedData.load(data_dir)
    eos, _ = special_ids(data.tokenizer)
    vocab = data.tokenizer.vocab_size
    model = _trainable(init, vocab) if init is not None else new_model(size, vocab, eos, settings.seed)
    t = _teacher(teacher, vocab)
    loss = lambda m, batch, gen: ar_loss(m, batch, gen, t)  # noqa: E731
    label = f"AR {size}" if init is None else f"AR from {init.name}"
    return train(model, loss, _train_stream(data, rows), data.held_out, settings, out, data.tokenizer,
                 resume=resume, resume_from=resume_from, label=label + (" (distilled)" if t is not None else ""),
                 objective={"rows": str(rows)} if rows else None)


def convert_to_diffusion(init_dir: Path, data_dir: Path, out: Path, settings: TrainSettings, *,
                         block_size: int = 32, sub_block_size: int = 8, resume: bool = False,
                         teacher: Path | None = None, suffix_mask_share: float = 0.0,
                         resume_from: Path | None = None, rows: Path | None = None,
                         decay_gamma: float | None = None) -> dict:
    """Fast-dLLM v2-style conversion: start from AR weights, add a mask token, train block
    diffusion (`suffix_mask_share`: see `block_masks`). Continues a block-diffusion model too."""
    if block_size < 1 or sub_block_size < 1 or block_size % sub_block_size:
        raise FailfastError(f"block size ({block_size}) must be a positive multiple of the "
                            f"sub-block size ({sub_block_size})")
    if not 0 <= suffix_mask_share <= 1:
        raise FailfastError(f"suffix mask share must be in [0, 1], got {suffix_mask_share}")
    if decay_gamma is not None and decay_gamma <= 0:
        raise FailfastError(f"position decay gamma must be > 0, got {decay_gamma}")
    data = PreparedData.load(data_dir)
    _, mask_id = special_ids(data.tokenizer)
    model = _reconfigured(_trainable(init_dir, data.tokenizer.vocab_size), mask_token_id=mask_id, block_size=block_size,
                          sub_block_size=sub_block_size, failfast_denoise=None)  # block modes, not an init's
    t = _teacher(teacher, data.tokenizer.vocab_size)
    loss = lambda m, batch, gen: block_diffusion_loss(m, batch, block_size, mask_id, gen, t,  # noqa: E731
                                                      suffix_mask_share, decay_gamma)
    objective = {"suffix_mask_share": suffix_mask_share, **({"decay_gamma": decay_gamma} if decay_gamma else {}),
                 **({"rows": str(rows)} if rows else {})}
    return train(model, loss, _train_stream(data, rows), data.held_out, settings, out, data.tokenizer,
                 resume=resume, resume_from=resume_from, label="AR -> block diffusion", objective=objective)


def train_causal_windows(init_dir: Path, data_dir: Path, out: Path, settings: TrainSettings, *, masks: int = 3,
                         anchor_share: int = 4, resume: bool = False, resume_from: Path | None = None,
                         rows: Path | None = None) -> dict:
    """Causal-window drafting (docs/design.md, "Causal windows"): continue a checkpoint (a
    block-diffusion drafter, or an AR model, which gets the corpus's mask token) on
    `causal_window_loss` with windows of `masks` masks behind `anchor_share`-th of the
    positions. Its config.json names causal windows as its drafting mode."""
    from failfast.drafters.causal_window import CAUSAL_WINDOWS

    if masks < 1 or anchor_share < 1:
        raise FailfastError(f"window masks and anchor share must be >= 1, got {masks} and {anchor_share}")
    if masks > settings.seq_len - 2:
        raise FailfastError(f"{masks} window masks need training windows of at least {masks + 2} tokens, "
                            f"got {settings.seq_len}")
    data = PreparedData.load(data_dir)
    _, mask_id = special_ids(data.tokenizer)
    model = _reconfigured(_trainable(init_dir, data.tokenizer.vocab_size), mask_token_id=mask_id,
                          failfast_denoise=CAUSAL_WINDOWS)
    loss = lambda m, batch, gen: causal_window_loss(m, batch, mask_id, gen, masks, anchor_share)  # noqa: E731
    objective = {"window_masks": masks, "anchor_share": anchor_share, **({"rows": str(rows)} if rows else {})}
    return train(model, loss, _train_stream(data, rows), data.held_out, settings, out, data.tokenizer,
                 resume=resume, resume_from=resume_from, label="causal windows", objective=objective)
