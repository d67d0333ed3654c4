"""Shared fixtures: tiny random Qwen2 checkpoints written to disk in float64."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from failfast.model import ModelConfig, Transformer
from failfast.model.checkpoint import save_model


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=(1,))
    base.update(overrides)
    return ModelConfig(**base)


def random_model(cfg: ModelConfig, seed: int, scale: float = 0.5) -> Transformer:
    """A random model whose logits are spread enough that greedy choices are not near-ties."""
    torch.manual_seed(seed)
    model = Transformer(cfg).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.1 * torch.randn_like(p))
    return model.eval()


def write_model(folder: Path, cfg: ModelConfig, seed: int) -> Path:
    save_model(random_model(cfg, seed), folder)
    return folder


def set_eos(folder: Path, eos: int | None) -> None:
    """Rewrite a checkpoint's end-of-sequence id in place."""
    cfg_path = folder / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["eos_token_id"] = eos
    cfg_path.write_text(json.dumps(raw))


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    return write_model(tmp_path / "target", tiny_config(), seed=0)
