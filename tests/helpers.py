"""Test helpers: tiny random Qwen2 / Qwen3 / DFlash / EAGLE-3 checkpoints written to disk, prompts."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from failfast.model import ModelConfig, Transformer
from failfast.model.checkpoint import save_model
from failfast.model.dflash import DFlashModel
from failfast.model.eagle3 import Eagle3Model


def tiny_config(**overrides) -> ModelConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rope_theta=10000.0, tie_word_embeddings=False, eos_token_ids=(1,))
    base.update(overrides)
    return ModelConfig(**base)


def tiny_dflash_config(target: ModelConfig, **overrides) -> ModelConfig:
    """A DFlash drafter for `target` (its hidden size; Qwen3 layers) reading its layers 0 and last."""
    base = dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=48,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=target.max_position_embeddings, model_type="qwen3", qk_norm=True,
                attention_bias=False, mask_token_id=target.vocab_size - 1, block_size=4,
                target_layer_ids=(0, target.num_hidden_layers - 1), eos_token_ids=target.eos_token_ids)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_eagle3_config(target: ModelConfig, **overrides) -> ModelConfig:
    """An EAGLE-3 drafter for `target` (its hidden size; one Qwen3-style layer) reading its layers 0 and last."""
    base = dict(vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=48,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                max_position_embeddings=target.max_position_embeddings, model_type="qwen3", qk_norm=True,
                attention_bias=False, target_layer_ids=(0, target.num_hidden_layers - 1), eagle3=True,
                eos_token_ids=target.eos_token_ids)
    base.update(overrides)
    return ModelConfig(**base)


def random_model(cfg: ModelConfig, seed: int, scale: float = 0.5) -> Transformer | DFlashModel | Eagle3Model:
    """A random model whose logits are spread enough that greedy choices are not near-ties."""
    torch.manual_seed(seed)
    kind = DFlashModel if cfg.is_dflash else Eagle3Model if cfg.is_eagle3 else Transformer
    model = kind(cfg).to(torch.float64)
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


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 90, (length,), generator=torch.Generator().manual_seed(seed + length)).tolist()


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json whose token i reads `<i>` (decoded text joins with spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
