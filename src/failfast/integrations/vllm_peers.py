"""vLLM on the same checkpoint, as a benchmark peer: plain decoding, its own speculative
methods, and failfast's proposer inside it (README, "vLLM").

Needs the `vllm` extra. Each engine runs its core in a process of its own (vLLM's CPU
backend registers its kernels once per process, so a second in-process engine fails), which
inherits the proposer's config through the environment this module sets;
`VLLM_CPU_KVCACHE_SPACE` (GiB of KV cache per engine) defaults to 2 here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from failfast.decode.stats import GenerationStats
from failfast.errors import GenerationInputError
from failfast.drafters.lookup import LookupSettings
from failfast.integrations.vllm import ProposerConfig

# Peer name -> what it asks vLLM for ("failfast": our proposer through the custom-class hook).
# "vllm-failfast" drafts behind its speculation gate (the proposer's default), "-ungated" in every step,
# "-lookup" behind the gate with prompt lookup in front of the drafter.
PROPOSER_METHODS = ("vllm-failfast", "vllm-failfast-ungated", "vllm-failfast-lookup")
VLLM_METHODS = ("vllm-ar", "vllm-ngram", "vllm-draft-model", *PROPOSER_METHODS)
DRAFT_MODEL_K = 4   # vLLM's draft-model method with our AR drafter: the bench's ar-fixed-4
NGRAM_K = 4
FAILFAST_N_MAX = 32  # num_speculative_tokens for our proposer: FailFast's N_max inside vLLM
PROPOSER_CLASS = "failfast.integrations.vllm.FailFastProposer"


def vllm_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("vllm") is not None


def speculative_config(method: str, ar_drafter: Path | None = None) -> dict[str, Any] | None:
    """vLLM's `speculative_config` for a peer method."""
    if method == "vllm-ar":
        return None
    if method == "vllm-ngram":
        return {"method": "ngram", "num_speculative_tokens": NGRAM_K, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if method == "vllm-draft-model":
        if ar_drafter is None:
            raise GenerationInputError("vllm-draft-model needs the AR drafter's folder")
        return {"method": "draft_model", "model": str(ar_drafter), "num_speculative_tokens": DRAFT_MODEL_K}
    if method in PROPOSER_METHODS:
        return {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": FAILFAST_N_MAX}
    raise GenerationInputError(f"unknown vLLM method {method!r} (choose from {', '.join(VLLM_METHODS)})")


def proposer_config(method: str, drafter: str, dtype: torch.dtype) -> ProposerConfig | None:
    """Our proposer's settings for a peer method that uses it (None for vLLM's own methods)."""
    if method not in PROPOSER_METHODS:
        return None
    return ProposerConfig(drafter=drafter, dtype=str(dtype).removeprefix("torch."), gate=method != "vllm-failfast-ungated",
                          lookup_tokens=LookupSettings().max_tokens if method == "vllm-failfast-lookup" else None)


@dataclass(frozen=True)
class VllmCompletion:
    """One request's greedy tokens and what vLLM reports of it (tokens, target forwards,
    drafted and accepted tokens; vLLM does not expose its internal timings, so `wall_s` and
    the drafter fields stay 0)."""

    token_ids: list[int]
    stats: GenerationStats


class VllmGenerator:
    """A vLLM engine over a failfast checkpoint folder: greedy token ids in, token ids out."""

    def __init__(self, target: Path, dtype: torch.dtype, speculative: dict[str, Any] | None = None,
                 proposer: ProposerConfig | None = None, max_model_len: int = 2048, max_num_seqs: int = 16) -> None:
        if not vllm_available():
            raise GenerationInputError("vLLM is not installed (pip install 'failfast[vllm]'; README, \"vLLM\")")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        if proposer is not None:  # read by FailFastProposer when vLLM builds it, in the engine's process
            os.environ.update(proposer.to_env())
        from vllm import LLM
        # Per-request acceptance counts come back with each finished request (vLLM's global
        # counters are aggregated asynchronously and lag the call that produced them).
        metrics = {"per_request_spec_decode_metrics": "summary"} if speculative else {}
        self.llm = LLM(model=str(target), dtype=str(dtype).removeprefix("torch."), max_model_len=max_model_len,
                       max_num_seqs=max_num_seqs, enforce_eager=True, speculative_config=speculative, seed=0,
                       **metrics)

    def generate(self, prompts: list[list[int]], max_new_tokens: int | list[int]) -> list[VllmCompletion]:
        """Greedy continuations, in prompt order; up to `max_num_seqs` decode together."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=n) for n in lengths]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [_completion(o.outputs[0]) for o in outs]

    def close(self) -> None:
        """Stop the engine's core process now (not at interpreter exit, when logging is gone)."""
        self.llm.llm_engine.engine_core.shutdown()


def _completion(completion: Any) -> VllmCompletion:
    """A vLLM completion with failfast statistics. Each target forward of a request commits
    its accepted draft tokens plus one (the prefill's forward commits the first token), so
    its forwards are its tokens minus the accepted ones."""
    tokens = list(completion.token_ids)
    spec = getattr(completion, "spec_decode_metrics", None)
    accepted = sum(j * count for j, count in enumerate(spec.histogram)) if spec is not None else 0
    drafted = spec.num_draft_tokens if spec is not None else 0
    forwards = len(tokens) - accepted
    return VllmCompletion(tokens, GenerationStats(tokens=len(tokens), rounds=forwards, drafted=drafted,
                                                  accepted=accepted, target_forwards=forwards))
