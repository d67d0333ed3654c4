"""What training the drafters that read target features shares (DFlash, EAGLE-3): a fresh
model shaped after the target, continuing a trained one, the target and rows to train on,
and the position-weighted loss over the draft vocabulary (docs/design.md, "Training")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from failfast.errors import FailfastError
from failfast.model import LoadedModel, ModelConfig, load_model
from failfast.train.data import PreparedData
from failfast.train.draft_vocab import write_draft_vocab
from failfast.train.loop import LossFn, TrainSettings, train
from failfast.train.selfdistill import MANIFEST_FILE, load_rows
from failfast.train.tokenizer import special_ids

DEFAULT_DECAY_GAMMA = 7.0  # DFlash's choice for blocks of 16: the k-th drafted token weighs exp(-(k-1)/7)


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and last layer of the target: the spread z-lab's and EAGLE-3's drafters read."""
    return tuple(sorted({1 % num_layers, num_layers // 2, num_layers - 1}))


def drafter_config(target: ModelConfig, layers: int, target_layer_ids: tuple[int, ...], **kind: Any) -> ModelConfig:
    """Qwen3 layers of the target's width and heads, reading `target_layer_ids`; `kind`: the
    kind's own fields (block size and mask token, or eagle3)."""
    if any(not 0 <= i < target.num_hidden_layers for i in target_layer_ids):
        raise FailfastError(f"target layers {list(target_layer_ids)} do not exist in a {target.num_hidden_layers}-layer target")
    return ModelConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                       intermediate_size=target.intermediate_size, num_hidden_layers=layers,
                       num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                       max_position_embeddings=target.max_position_embeddings, rms_norm_eps=target.rms_norm_eps,
                       rope_theta=target.rope_theta, head_dim=target.head_dim, eos_token_ids=target.eos_token_ids,
                       model_type="qwen3", attention_bias=False, qk_norm=True,
                       target_layer_ids=tuple(sorted(target_layer_ids)),
                       extra={"num_target_layers": target.num_hidden_layers}, **kind)


def initialised(model: nn.Module, layers: int) -> nn.Module:
    """Small normal weights, output projections scaled down by depth (as GPT-2 does)."""
    scale = 0.02 / (2 * layers) ** 0.5
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=scale if name.endswith(("o_proj", "down_proj")) else 0.02)
    return model


def continued(init: Path, target: ModelConfig, kind: str, fits: Callable[[ModelConfig], bool],
              asked: dict[str, Any]) -> nn.Module:
    """A trained drafter of `kind` to continue from (float32), checked against the target and
    against what was asked for (`asked`: config field -> wanted value, or None for any)."""
    loaded = load_model(init, pack=False)  # its weights train: no packed layout or fused copies
    cfg = loaded.config
    if not fits(cfg):
        raise FailfastError(f"--init {init} is not a {kind} drafter")
    if (cfg.hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
        raise FailfastError(f"{kind} drafter {init} (hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}) does not "
                            f"fit the target (hidden {target.hidden_size}, vocabulary {target.vocab_size})")
    for field, want in asked.items():
        has = getattr(cfg, field)
        if want is not None and want != has:
            raise FailfastError(f"{kind} drafter {init} has {field.replace('_', ' ')} {has}, not the {want} asked for")
    return loaded.model.requires_grad_(True)


def weighted_cross_entropy(hidden: Tensor, lm_head: nn.Module, labels: Tensor, weights: Tensor,
                           vocab: Tensor | None, teacher: Tensor | None = None) -> Tensor:
    """Weighted mean cross-entropy of the target's head over hidden states [N, hidden] against
    labels [N]. With `vocab` (sorted token ids: the draft vocabulary) the head covers only
    those rows, as in drafting, and labels outside it carry no loss.

    With `teacher` (the target's final hidden states [N, hidden] at the position before each
    label) the labels are soft: the target's own next-token distribution at temperature 1
    (over `vocab`, renormalised), whose mode greedy verification checks; a sampled row's
    token is then no longer a noisy label."""
    head = lm_head.weight if vocab is None else lm_head.weight[vocab.to(hidden.device)]
    logits = F.linear(hidden, head).float()
    if teacher is not None:
        with torch.no_grad():
            soft = F.linear(teacher, head).float().softmax(-1)
        losses = F.cross_entropy(logits, soft, reduction="none")
    else:
        if vocab is not None:
            vocab = vocab.to(hidden.device)
            index = torch.searchsorted(vocab, labels).clamp(max=len(vocab) - 1)
            inside = vocab[index] == labels
            labels, weights = torch.where(inside, index, 0), weights * inside
        losses = F.cross_entropy(logits, labels, reduction="none")
    return (weights * losses).sum() / weights.sum().clamp(min=1e-6)


@dataclass
class FeatureTraining:
    """The frozen target, the corpus data (tokenizer, held-out stream) and the self-distilled
    rows a feature-reading drafter trains on, and the draft vocabulary its loss covers."""

    target: LoadedModel
    data: PreparedData
    mask_id: int
    first_anchor: int  # the rows' prompt length: target-written tokens start here
    vocab: Tensor | None

    @classmethod
    def load(cls, target_dir: Path, data_dir: Path, rows: Path, out: Path,
             draft_vocab_size: int | None) -> "FeatureTraining":
        data = PreparedData.load(data_dir)
        _, mask_id = special_ids(data.tokenizer)
        target = load_model(target_dir)
        if target.config.vocab_size != data.tokenizer.vocab_size:
            raise FailfastError(f"target {target_dir} has vocabulary size {target.config.vocab_size}, the corpus "
                                f"tokenizer {data.tokenizer.vocab_size}")
        first_anchor = json.loads((Path(rows) / MANIFEST_FILE).read_text())["settings"]["prompt_len"]
        vocab = None
        if draft_vocab_size is not None and draft_vocab_size < target.config.vocab_size:
            Path(out).mkdir(parents=True, exist_ok=True)
            vocab = torch.tensor(write_draft_vocab(Path(rows), Path(out), draft_vocab_size)["ids"])
        return cls(target, data, mask_id, first_anchor, vocab)

    def run(self, model: nn.Module, loss: LossFn, rows: Path, out: Path, settings: TrainSettings, label: str,
            objective: dict, resume: bool, resume_from: Path | None) -> dict:
        """Train `model` (the target's embedding and head attached) on the rows."""
        model.attach(self.target.model.model.embed_tokens, self.target.model.lm_head)
        objective = {"rows": str(rows), "target": self.target.path.name, **objective,
                     "first_anchor": self.first_anchor, "draft_vocab_size": None if self.vocab is None else len(self.vocab)}
        return train(model, loss, load_rows(rows), self.data.held_out, settings, out, self.data.tokenizer,
                     resume=resume, resume_from=resume_from, label=label, objective=objective)
