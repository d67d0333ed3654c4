"""A target, a block-diffusion drafter and a DFlash drafter trained for seconds on a
predictable sequence.

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
from failfast.train.dflash import dflash_loss
from failfast.train.loop import TrainSettings, train
from failfast.train.objectives import ar_loss, block_diffusion_loss
from tests.helpers import tiny_config, tiny_dflash_config

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


def train_dflash_drafter(folder: Path, target_dir: Path) -> Path:
    """A DFlash drafter for the counting target, trained for seconds on its features."""
    target = load_model(target_dir)
    cfg = tiny_dflash_config(target.config, block_size=BLOCK, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, mask_token_id=MASK_ID)
    torch.manual_seed(0)
    drafter = DFlashModel(cfg)
    drafter.attach(target.model.model.embed_tokens, target.model.lm_head)
    loss = lambda m, b, g: dflash_loss(m, target.model, b, g, first_anchor=1)  # noqa: E731
    settings = TrainSettings(steps=150, batch_size=16, seq_len=48, lr=3e-3, warmup=10, save_every=1000, eval_batches=1,
                             compile=False)
    stream = counting_stream()
    train(drafter, loss, stream, stream, settings, folder / "dflash-run", None)
    save_model(drafter, folder / "dflash")
    return folder / "dflash"
