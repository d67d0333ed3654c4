"""Drafter construction in one place: the CLI, the library and the benchmark build the same
drafter from the same checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

from failfast.drafters.autoregressive import ARDrafter
from failfast.drafters.base import Drafter
from failfast.drafters.block_diffusion import DEFAULT_DENOISE, DEFAULT_UNMASK_THRESHOLD, DENOISE_MODES, BlockDiffusionDrafter
from failfast.drafters.causal_window import CAUSAL_WINDOWS, CausalWindowDrafter
from failfast.drafters.dflash import DFlashDrafter
from failfast.drafters.eagle3 import Eagle3Drafter
from failfast.errors import CheckpointError, IncompatibleModelsError, PolicyError
from failfast.model import LoadedModel, ModelDescription
from failfast.model.transformer import fast_drafting_attention

DRAFT_VOCAB_FILE = "draft_vocab.json"
DENOISE_CHOICES = (*DENOISE_MODES, CAUSAL_WINDOWS)  # a mask-token drafter's modes: the block modes, causal windows


def check_vocabularies(target: LoadedModel | ModelDescription, drafter: LoadedModel) -> None:
    """Drafter and target must agree on every token of the target's tokenizer.

    Embedding sizes may differ (checkpoints pad them), and a drafter may add tokens such
    as its mask token; without tokenizers, the embedding sizes must match.
    """
    if target.tokenizer is not None and drafter.tokenizer is not None:
        t_vocab = target.tokenizer.inner.get_vocab(with_added_tokens=True)
        d_vocab = drafter.tokenizer.inner.get_vocab(with_added_tokens=True)
        differing = [tok for tok, i in t_vocab.items() if d_vocab.get(tok) != i]
        if differing:
            raise IncompatibleModelsError(
                f"drafter {drafter.path} and target {target.path} have different vocabularies "
                f"({len(differing)} of the target's {len(t_vocab)} tokens differ, e.g. {differing[0]!r})")
    elif target.config.vocab_size != drafter.config.vocab_size:
        raise IncompatibleModelsError(
            f"drafter vocabulary size {drafter.config.vocab_size} differs from the target's "
            f"{target.config.vocab_size}")


def load_draft_vocab(folder: Path) -> list[int] | None:
    """The token ids of a checkpoint's `draft_vocab.json` (written by `failfast train
    draft-vocab`), or None when it has none."""
    path = Path(folder) / DRAFT_VOCAB_FILE
    if not path.is_file():
        return None
    try:
        ids = json.loads(path.read_text())["ids"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a draft vocabulary ({exc})") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise CheckpointError(f"{path}: ids must be a list of token ids")
    return ids


def make_drafter(target: LoadedModel | ModelDescription, drafter: LoadedModel,
                 unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD, denoise: str | None = None,
                 sub_block_size: int | None = None, full_vocab: bool = False) -> Drafter:
    """The drafter a checkpoint is: DFlash or EAGLE-3 (both read the target's features), a
    mask-token drafter, or else autoregressive. A mask-token drafter drafts in the mode
    `denoise` (None: the one its config.json names, else Fast-dLLM v2's sliding windows):
    causal windows, or a block mode, which alone takes `unmask_threshold` and `sub_block_size`.
    A checkpoint's draft vocabulary is used unless `full_vocab`. Drafters that read only token
    ids accept a target's description (its weights run in another engine)."""
    check_vocabularies(target, drafter)
    limit = min(target.config.vocab_size, drafter.config.vocab_size)
    vocab = None if full_vocab else load_draft_vocab(drafter.path)
    if drafter.config.reads_target and not isinstance(target, LoadedModel):
        raise IncompatibleModelsError(
            f"drafter {drafter.path} reads the target's hidden states, so it needs the target loaded in "
            "failfast's engine; a target that runs elsewhere takes an AR or block-diffusion drafter")
    if getattr(target, "model", None) is not drafter.model:  # a model that also verifies keeps exact attention
        fast_drafting_attention(drafter.model)
    if drafter.config.is_dflash:
        return DFlashDrafter(drafter, target, limit, vocab)
    if drafter.config.is_eagle3:
        return Eagle3Drafter(drafter, target, limit, vocab)
    if drafter.config.is_block_diffusion or drafter.config.mask_token_id is not None:
        mode = denoise or drafter.config.failfast_denoise or DEFAULT_DENOISE
        if mode not in DENOISE_CHOICES:
            named = "" if denoise else f" (failfast_denoise in {drafter.path}/config.json)"
            raise (PolicyError if denoise else CheckpointError)(
                f"denoising pass must be one of {', '.join(DENOISE_CHOICES)}, got {mode!r}{named}")
        if mode != CAUSAL_WINDOWS:
            return BlockDiffusionDrafter(drafter, limit, unmask_threshold, mode, sub_block_size, vocab)
        if sub_block_size is not None or unmask_threshold != DEFAULT_UNMASK_THRESHOLD:
            raise PolicyError("causal windows draft one window per pass: a sub-block size and an unmask threshold "
                              "apply to the block modes (--denoise sliding, prefix, sub-block, full-block)")
        return CausalWindowDrafter(drafter, limit, vocab)
    return ARDrafter(drafter, limit, draft_vocab=vocab)
