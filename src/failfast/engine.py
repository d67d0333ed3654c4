"""The draft -> verify -> commit loop (DESIGN.md sections 5-7).

Invariant between rounds: the target cache holds every committed token except the last
one, which is fed first in the next verification forward.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from failfast.drafters import Drafter
from failfast.errors import GenerationInputError
from failfast.model import LoadedModel
from failfast.policies import Policy
from failfast.stats import GenerationStats, RoundStats
from failfast.stopping import StopStrings
from failfast.verify import Sampler, SamplingParams, verify_draft


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only; ends with EOS when generation stopped on one
    stop_reason: str      # "eos", "stop" (a stop string) or "length"
    stats: GenerationStats
    text: str | None = None  # decoded output (cut exactly before a stop string); None without a tokenizer


class SpeculativeEngine:
    """Generates exactly the target's tokens; a drafter and policy only change the speed.

    With no drafter this is plain autoregressive decoding in the same runtime.
    """

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None,
                 policy: Policy | None = None) -> None:
        if (drafter is None) != (policy is None):
            raise GenerationInputError("a drafter needs a policy and a policy needs a drafter")
        self.target = target
        self.drafter = drafter
        self.policy = policy

    def _check_request(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise GenerationInputError("the prompt is empty")
        if max_new_tokens < 1:
            raise GenerationInputError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise GenerationInputError(f"prompt token ids must be in [0, {vocab})")
        limit = self.target.config.max_position_embeddings
        if len(prompt_ids) + max_new_tokens > limit:
            raise GenerationInputError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the target's context of {limit} tokens")

    def _draft(self, committed: list[int], budget: int) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        confs: list[float] = []
        if self.drafter is None or budget <= 0:
            return tokens, confs
        self.drafter.begin(committed)
        while (want := min(self.policy.request(confs), budget - len(tokens))) > 0:
            new, new_confs = self.drafter.draft(want)
            if not new:  # the drafter has nothing more to propose
                break
            tokens += new
            confs += new_confs
        return tokens, confs

    def _stop_strings(self, stop: Sequence[str]) -> StopStrings | None:
        if not stop:
            return None
        if self.target.tokenizer is None:
            raise GenerationInputError("stop strings need the target's tokenizer.json")
        return StopStrings(stop, self.target.tokenizer.decode)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        """Exactly the target's continuation of `prompt_ids` (greedy, or sampled with a seed)."""
        self._check_request(prompt_ids, max_new_tokens)
        stops = self._stop_strings(stop)
        sampler = Sampler(sampling)
        eos = set(self.target.config.eos_token_ids)
        model = self.target.model
        stats = GenerationStats()
        t_start = time.perf_counter()
        total_len = len(prompt_ids) + max_new_tokens
        cache = model.new_cache(total_len)
        if self.drafter is not None:
            self.drafter.prepare(total_len)
        committed = list(prompt_ids)
        if len(committed) > 1:
            model(torch.tensor([committed[:-1]], device=model.device), 0, cache, logits_at=slice(0, 0))
            stats.target_forwards += 1
        generated: list[int] = []
        stop_reason = "length"
        stop_text = None
        while len(generated) < max_new_tokens and stop_reason == "length":
            t0 = time.perf_counter()
            forwards_before = self.drafter.forwards if self.drafter else 0
            draft, confs = self._draft(committed, max_new_tokens - len(generated) - 1)
            t1 = time.perf_counter()
            n = len(committed)
            logits = model(torch.tensor([[committed[-1], *draft]], device=model.device), n - 1, cache)
            accepted, next_token = verify_draft(logits[0], draft, sampler, n)
            cache.rollback(n + accepted)
            stats.target_forwards += 1
            t2 = time.perf_counter()
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.record(RoundStats(len(draft), accepted,
                                    (self.drafter.forwards if self.drafter else 0) - forwards_before, confs))
            for tok in (*draft[:accepted], next_token):
                generated.append(tok)
                committed.append(tok)
                if tok in eos:
                    stop_reason = "eos"
                    break
                if len(generated) == max_new_tokens:
                    break
            if stops is not None and (hit := stops.find(generated)) is not None:
                keep, stop_text = hit
                del generated[keep:]
                stop_reason = "stop"
        stats.tokens = len(generated)
        stats.wall_s = time.perf_counter() - t_start
        tokenizer = self.target.tokenizer
        text = stop_text if stop_text is not None else tokenizer.decode(generated) if tokenizer else None
        return GenerationResult(generated, stop_reason, stats, text)
