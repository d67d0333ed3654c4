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

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from failfast.errors import FailfastError
from failfast.model import ModelConfig, Transformer, load_model
from failfast.model.dflash import DFlashModel
from failfast.train.data import PreparedData
from failfast.train.draft_vocab import write_draft_vocab
from failfast.train.loop import TrainSettings, train
from failfast.train.selfdistill import MANIFEST_FILE, load_rows
from failfast.train.tokenizer import special_ids

# Windows per row and step, by pass index (0: a round's first pass, j: its j-th extension).
# First passes dominate, as in drafting, where every round runs one and few run extensions.
# The target's forward over the rows is a fixed cost per step, so many windows share it: 12
# first-pass windows give 3x the first-pass examples of 4 for 1.2x the step time (1 thread,
# bf16 autocast, draft-vocabulary head).
WINDOW_PASSES = (0,) * 12 + (1, 2)
DEFAULT_DECAY_GAMMA = 7.0  # DFlash's choice for blocks of 16


def window_shape(pass_index: int, block_size: int) -> tuple[int, int]:
    """(window length, known tokens at its start) of a drafting pass."""
    if pass_index == 0:
        return block_size, 1
    return (pass_index + 1) * block_size, pass_index * block_size


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and last layer of the target: the spread z-lab's drafters read."""
    return tuple(sorted({1 % num_layers, num_layers // 2, num_layers - 1}))


def new_dflash(target: ModelConfig, layers: int, target_layer_ids: tuple[int, ...], block_size: int,
               mask_token_id: int, seed: int) -> DFlashModel:
    """A fresh DFlash drafter for `target`: Qwen3 layers of the target's width and heads."""
    if any(not 0 <= i < target.num_hidden_layers for i in target_layer_ids):
        raise FailfastError(f"target layers {list(target_layer_ids)} do not exist in a {target.num_hidden_layers}-layer target")
    cfg = ModelConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                      intermediate_size=target.intermediate_size, num_hidden_layers=layers,
                      num_attention_heads=target.num_attention_heads, num_key_value_heads=target.num_key_value_heads,
                      max_position_embeddings=target.max_position_embeddings, rms_norm_eps=target.rms_norm_eps,
                      rope_theta=target.rope_theta, head_dim=target.head_dim, eos_token_ids=target.eos_token_ids,
                      model_type="qwen3", attention_bias=False, qk_norm=True, mask_token_id=mask_token_id,
                      block_size=block_size, target_layer_ids=tuple(sorted(target_layer_ids)),
                      extra={"num_target_layers": target.num_hidden_layers})
    torch.manual_seed(seed)
    model = DFlashModel(cfg)
    scale = 0.02 / (2 * layers) ** 0.5
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=scale if name.endswith(("o_proj", "down_proj")) else 0.02)
    return model


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
                passes: tuple[int, ...] = WINDOW_PASSES, vocab: Tensor | None = None) -> Tensor:
    """Position-decayed cross-entropy of the drafter's masked window positions against the
    rows' tokens (the target's own continuations), given the target's features. With `vocab`
    (sorted token ids: the draft vocabulary) the head covers only those rows, as in drafting,
    and tokens outside it carry no loss."""
    cfg = model.config
    b, length = tokens.shape
    device = tokens.device
    with torch.no_grad():
        features = target.features(tokens, cfg.target_layer_ids)
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
    labels = window_tokens[:, masked].flatten()
    weights = torch.exp(-(rank[masked] - 1).float() / decay_gamma).expand(b, -1).flatten()
    if vocab is None:
        logits = target.lm_head(hidden[:, masked]).float()
    else:
        vocab = vocab.to(device)
        logits = F.linear(hidden[:, masked], target.lm_head.weight[vocab]).float()
        index = torch.searchsorted(vocab, labels).clamp(max=len(vocab) - 1)
        inside = vocab[index] == labels
        labels, weights = torch.where(inside, index, 0), weights * inside
    losses = F.cross_entropy(logits.flatten(0, 1), labels, reduction="none")
    return (weights * losses).sum() / weights.sum().clamp(min=1e-6)


def initial_dflash(init: Path, target: ModelConfig, target_layer_ids: tuple[int, ...] | None,
                   block_size: int | None) -> DFlashModel:
    """A trained DFlash drafter to continue from (float32), checked against the target and
    against any layer ids or block size asked for."""
    loaded = load_model(init)
    cfg = loaded.config
    if not cfg.is_dflash:
        raise FailfastError(f"--init {init} is not a DFlash drafter")
    if (cfg.hidden_size, cfg.vocab_size) != (target.hidden_size, target.vocab_size):
        raise FailfastError(f"DFlash drafter {init} (hidden {cfg.hidden_size}, vocabulary {cfg.vocab_size}) does not "
                            f"fit the target (hidden {target.hidden_size}, vocabulary {target.vocab_size})")
    asked = {"target layers": (target_layer_ids and tuple(sorted(target_layer_ids)), cfg.target_layer_ids),
             "block size": (block_size, cfg.block_size)}
    for what, (want, has) in asked.items():
        if want and want != has:
            raise FailfastError(f"DFlash drafter {init} has {what} {has}, not the {want} asked for")
    return loaded.model.requires_grad_(True)


def train_dflash(target_dir: Path, data_dir: Path, rows: Path, out: Path, settings: TrainSettings, *,
                 layers: int = 2, target_layer_ids: tuple[int, ...] | None = None, block_size: int | None = None,
                 decay_gamma: float = DEFAULT_DECAY_GAMMA, init: Path | None = None, draft_vocab_size: int | None = None,
                 resume: bool = False, resume_from: Path | None = None) -> dict:
    """Train a DFlash drafter for the target in `target_dir` on its self-distillation `rows`
    (windows anchored in the target-written part of each row): a new one (blocks of 16 unless
    `block_size` says otherwise), or the drafter in `init` continued. With `draft_vocab_size`
    (below the vocabulary size) the loss covers only the draft vocabulary it will draft from
    (written into `out`)."""
    if (block_size is not None and block_size < 2) or decay_gamma <= 0 or layers < 1:
        raise FailfastError(f"need block size >= 2, decay gamma > 0 and >= 1 layer, got {block_size}, "
                            f"{decay_gamma} and {layers}")
    data = PreparedData.load(data_dir)
    _, mask_id = special_ids(data.tokenizer)
    target = load_model(target_dir)
    if target.config.vocab_size != data.tokenizer.vocab_size:
        raise FailfastError(f"target {target_dir} has vocabulary size {target.config.vocab_size}, the corpus "
                            f"tokenizer {data.tokenizer.vocab_size}")
    if init is not None:
        model = initial_dflash(Path(init), target.config, target_layer_ids, block_size)
    else:
        layer_ids = target_layer_ids or default_target_layers(target.config.num_hidden_layers)
        model = new_dflash(target.config, layers, layer_ids, block_size or 16, mask_id, settings.seed)
    model.attach(target.model.model.embed_tokens, target.model.lm_head)
    first_anchor = json.loads((Path(rows) / MANIFEST_FILE).read_text())["settings"]["prompt_len"]
    vocab = None
    if draft_vocab_size is not None and draft_vocab_size < target.config.vocab_size:
        Path(out).mkdir(parents=True, exist_ok=True)
        vocab = torch.tensor(write_draft_vocab(Path(rows), Path(out), draft_vocab_size)["ids"])
    loss = lambda m, batch, gen: dflash_loss(m, target.model, batch, gen, first_anchor, decay_gamma,  # noqa: E731
                                             vocab=vocab)
    objective = {"rows": str(rows), "target": Path(target_dir).name, "decay_gamma": decay_gamma,
                 "window_passes": list(WINDOW_PASSES), "first_anchor": first_anchor,
                 "draft_vocab_size": None if vocab is None else len(vocab)}
    return train(model, loss, load_rows(rows), data.held_out, settings, out, data.tokenizer, resume=resume,
                 resume_from=resume_from, label="DFlash drafter", objective=objective)
