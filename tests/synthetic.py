"""A target, a block-diffusion drafter and DFlash and EAGLE-3 drafters trained for seconds on
a predictable sequence.

The corpus counts upward modulo a small vocabulary (..., 7, 8, 9, 10, ...), so a trained
drafter really predicts the target and long drafts spanning several blocks are accepted.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from failfast.model import Transformer, load_model
from failfast.model.checkpoint import save_model
from failfast.model.dflash import DFlashModel
from failfast.model.eagle3 import Eagle3Model
from failfast.train.dflash import dflash_loss
from failfast.train.eagle3 import eagle3_loss
from failfast.train.loop import TrainSettings, train
from failfast.train.objectives import ar_loss, block_diffusion_loss
from tests.helpers import tiny_config, tiny_dflash_config, tiny_eagle3_config

CYCLE = 40          # tokens 0..39 form the cycle
MASK_ID = 47        # outside the cycle, inside the vocabulary
BLOCK, SUB_BLOCK = 8, 4


def counting_stream(length: int = 4000) -> torch.Tensor:
    return torch.arange(length) % CYCLE


def train_pair(folder: Path) -> tuple[Path, Path]:
    cfg = tiny_config(vocab_size=48, hidden_size=48, intermediate_size=96, eos_token_ids=())
    stream = counting_stream()
    settings = TrainSettings(steps=120, batch_size=16, seq_len=48, lr=3e-3, warmup=10, save_every=1000, eval_batches=1,
                             compile=False)
    torch.manual_seed(0)
    target = Transformer(cfg)
    train(target, ar_loss, stream, stream, settings, folder / "target-run", None)
    save_model(target, folder / "target")
    drafter = Transformer(replace(cfg, mask_token_id=MASK_ID, block_size=BLOCK, sub_block_size=SUB_BLOCK))
    drafter.load_state_dict(target.state_dict())
    drafter.requires_grad_(True)
    loss = lambda m, b, g: block_diffusion_loss(m, b, BLOCK, MASK_ID, g)  # noqa: E731
    train(drafter, loss, stream, stream, replace(settings, steps=200), folder / "drafter-run", None)
    save_model(drafter, folder / "drafter")
    return folder / "target", folder / "drafter"


def _train_on_features(folder: Path, target_dir: Path, name: str, cfg_of, loss_of) -> Path:
    """A drafter that reads the counting target's features, trained for seconds: `cfg_of`
    gives its config from the target's, `loss_of(target)` its loss."""
    target = load_model(target_dir)
    cfg = cfg_of(target.config)
    torch.manual_seed(0)
    drafter = (DFlashModel if cfg.is_dflash else Eagle3Model)(cfg)
    drafter.attach(target.model.model.embed_tokens, target.model.lm_head)
    settings = TrainSettings(steps=150, batch_size=16, seq_len=48, lr=3e-3, warmup=10, save_every=1000, eval_batches=1,
                             compile=False)
    stream = counting_stream()
    train(drafter, loss_of(target), stream, stream, settings, folder / f"{name}-run", None)
    save_model(drafter, folder / name)
    return folder / name


def train_dflash_drafter(folder: Path, target_dir: Path) -> Path:
    """A DFlash drafter for the counting target."""
    return _train_on_features(
        folder, target_dir, "dflash",
        lambda t: tiny_dflash_config(t, block_size=BLOCK, intermediate_size=96, num_attention_heads=4,
                                     num_key_value_heads=2, mask_token_id=MASK_ID),
        lambda target: lambda m, b, g: dflash_loss(m, target.model, b, g, first_anchor=1))


def train_eagle3_drafter(folder: Path, target_dir: Path) -> Path:
    """An EAGLE-3 drafter for the counting target."""
    return _train_on_features(
        folder, target_dir, "eagle3",
        lambda t: tiny_eagle3_config(t, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2),
        lambda target: lambda m, b, g: eagle3_loss(m, target.model, b, first_anchor=1))
