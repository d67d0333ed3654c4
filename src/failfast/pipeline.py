"""Wire a target, an optional drafter and a policy into an engine; text in, text out."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from failfast.drafters.block_diffusion import DEFAULT_UNMASK_THRESHOLD
from failfast.drafters.factory import make_drafter
from failfast.drafters.lookup import LookupDrafter, LookupSettings
from failfast.embedded import resolve_model
from failfast.decode.engine import GenerationResult, SpeculativeEngine
from failfast.decode.gate import SpeculationGate
from failfast.errors import GenerationInputError
from failfast.model import LoadedModel, load_model
from failfast.model.int8 import load_drafter
from failfast.model.precision import default_dtype
from failfast.decode.policies import Policy, PolicyFactory
from failfast.decode.sampling import SamplingParams


@dataclass
class Pipeline:
    """A ready-to-use generator: `Pipeline.load(target, drafter, policy).generate(...)`.

    `target` and `drafter` are checkpoint folders or embedded model names
    ("target", "ar-drafter", "dllm-drafter").
    """

    target: LoadedModel
    engine: SpeculativeEngine

    @classmethod
    def load(cls, target: str | Path, drafter: str | Path | None = None, policy: Policy | PolicyFactory | None = None, *,
             unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD, denoise: str | None = None, sub_block_size: int | None = None,
             dtype: torch.dtype | None = None, drafter_dtype: torch.dtype | None = None,
             device: str = "cpu", full_vocab: bool = False, gate: SpeculationGate | None = None,
             lookup: LookupSettings | None = None, drafter_int8: bool | None = None) -> "Pipeline":
        """`drafter_dtype` (default: `dtype`), `drafter_int8` (the drafter's linear layers in
        int8, activations in its dtype, float32 for a float64 one; CPU; default: where it
        measured faster, `model/int8.py`), `full_vocab` (ignore the drafter's draft vocabulary),
        `gate` (skip drafting in rounds where plain rounds measure faster) and `lookup` (draft
        copies of earlier text first; alone when there is no drafter) never change the output,
        only the cost."""
        dtype = dtype or default_dtype(device)  # bfloat16 where it is fastest, else float32 (model/precision.py)
        tgt = load_model(resolve_model(target), dtype=dtype, device=device)
        if drafter is None and lookup is None:
            return cls(tgt, SpeculativeEngine(tgt))
        if policy is None:
            raise GenerationInputError("a drafter needs a policy (Fixed, FailFast or policies.cost_aware())")
        drf = None
        if drafter is not None:
            drafter_model = load_drafter(resolve_model(drafter), drafter_dtype or dtype, device, drafter_int8)
            drf = make_drafter(tgt, drafter_model, unmask_threshold, denoise, sub_block_size, full_vocab)
        if lookup is not None:
            drf = LookupDrafter(drf, lookup)
        return cls(tgt, SpeculativeEngine(tgt, drf, policy, gate))

    def encode(self, text: str) -> list[int]:
        if self.target.tokenizer is None:
            raise GenerationInputError(f"{self.target.path} has no tokenizer.json; pass token ids")
        return self.target.tokenizer.encode(text)

    def generate(self, prompt: str | list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return self.engine.generate(ids, max_new_tokens, sampling, stop)
