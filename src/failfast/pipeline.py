"""Wire a target, an optional drafter and a policy into an engine; text in, text out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from failfast.drafters import ARDrafter, BlockDiffusionDrafter, Drafter
from failfast.drafters.block_diffusion import DEFAULT_UNMASK_THRESHOLD
from failfast.embedded import resolve_model
from failfast.engine import GenerationResult, SpeculativeEngine
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.model import LoadedModel, load_model
from failfast.model.precision import default_dtype
from failfast.policies import Policy
from failfast.verify import SamplingParams


def check_vocabularies(target: LoadedModel, drafter: LoadedModel) -> None:
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


def make_drafter(target: LoadedModel, drafter: LoadedModel, unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD,
                 denoise: str = "sub-block", sub_block_size: int | None = None) -> Drafter:
    """A block-diffusion drafter if the checkpoint is one, else an autoregressive drafter
    (`unmask_threshold`, `denoise` and `sub_block_size` only apply to block diffusion)."""
    check_vocabularies(target, drafter)
    limit = min(target.config.vocab_size, drafter.config.vocab_size)
    if drafter.config.is_block_diffusion or drafter.config.mask_token_id is not None:
        return BlockDiffusionDrafter(drafter, limit, unmask_threshold, denoise, sub_block_size)
    return ARDrafter(drafter, limit)


@dataclass
class Pipeline:
    """A ready-to-use generator: `Pipeline.load(target, drafter, policy).generate(...)`.

    `target` and `drafter` are checkpoint folders or embedded model names
    ("target", "ar-drafter", "dllm-drafter").
    """

    target: LoadedModel
    engine: SpeculativeEngine

    @classmethod
    def load(cls, target: str | Path, drafter: str | Path | None = None, policy: Policy | None = None, *,
             unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD, denoise: str = "sub-block", sub_block_size: int | None = None,
             dtype: torch.dtype | None = None, drafter_dtype: torch.dtype | None = None,
             device: str = "cpu") -> "Pipeline":
        """`drafter_dtype` (default: `dtype`) never changes the output, only the drafting cost."""
        dtype = dtype or default_dtype(device)  # float32 on CPUs, bfloat16 on CUDA (model/precision.py)
        tgt = load_model(resolve_model(target), dtype=dtype, device=device)
        if drafter is None:
            return cls(tgt, SpeculativeEngine(tgt))
        if policy is None:
            raise GenerationInputError("a drafter needs a policy (Fixed or FailFast)")
        drafter_model = load_model(resolve_model(drafter), dtype=drafter_dtype or dtype, device=device)
        drf = make_drafter(tgt, drafter_model, unmask_threshold, denoise, sub_block_size)
        return cls(tgt, SpeculativeEngine(tgt, drf, policy))

    def encode(self, text: str) -> list[int]:
        if self.target.tokenizer is None:
            raise GenerationInputError(f"{self.target.path} has no tokenizer.json; pass token ids")
        return self.target.tokenizer.encode(text)

    def generate(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.engine.generate(ids, max_new_tokens, sampling, stop)
