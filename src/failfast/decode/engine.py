"""The draft -> verify -> commit loop, for one sequence or many (docs/design.md, "Engine").

Invariant between rounds: a sequence's target cache row holds every committed token except
the last one, which is fed first in its next verification forward. One request is a batch
of one on the same path; a batch verifies every active row in one ragged forward.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from failfast.drafters import Drafter
from failfast.errors import GenerationInputError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.ragged import Ragged
from failfast.decode.drafting import draft_alone, draft_together
from failfast.decode.gate import SpeculationGate
from failfast.decode.policies import Policy, PolicyFactory, is_policy_factory
from failfast.decode.stats import GenerationStats, RoundStats
from failfast.decode.stopping import StopStrings
from failfast.decode.sampling import Sampler, SamplingParams, accept_choices, greedy_tokens, verify_draft


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated ids only; ends with EOS when generation stopped on one
    stop_reason: str      # "eos", "stop" (a stop string) or "length"
    stats: GenerationStats
    text: str | None = None  # decoded output (cut exactly before a stop string); None without a tokenizer


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams | None = None
    stop: Sequence[str] = ()


@dataclass
class _Sequence:
    """One request in flight: its tokens, sampler, stop rules, drafter, cache row and stats."""

    index: int
    request: GenerationRequest
    drafter: Drafter | None
    cache: KVCache
    sampler: Sampler
    stops: StopStrings | None
    eos: frozenset[int]
    committed: list[int]
    generated: list[int] = field(default_factory=list)
    stop_reason: str = "length"
    stop_text: str | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    started: float = field(default_factory=time.perf_counter)

    @property
    def finished(self) -> bool:
        return self.stop_reason != "length" or len(self.generated) >= self.request.max_new_tokens

    @property
    def budget(self) -> int:
        """Draft tokens this round may propose (one more comes from the target)."""
        return self.request.max_new_tokens - len(self.generated) - 1

    def commit(self, tokens: Sequence[int]) -> None:
        """Append accepted tokens and the target's token, stopping at EOS, the length limit
        or a stop string."""
        for tok in tokens:
            self.generated.append(tok)
            self.committed.append(tok)
            if tok in self.eos:
                self.stop_reason = "eos"
                break
            if len(self.generated) == self.request.max_new_tokens:
                break
        if self.stops is not None and (hit := self.stops.find(self.generated)) is not None:
            keep, self.stop_text = hit
            del self.generated[keep:]
            self.stop_reason = "stop"

    def result(self, tokenizer) -> GenerationResult:
        self.stats.tokens = len(self.generated)
        self.stats.wall_s = time.perf_counter() - self.started
        text = self.stop_text if self.stop_text is not None else tokenizer.decode(self.generated) if tokenizer else None
        return GenerationResult(self.generated, self.stop_reason, self.stats, text)


class SpeculativeEngine:
    """Generates exactly the target's tokens; a drafter and policy only change the speed.

    With no drafter this is plain autoregressive decoding in the same runtime. `policy` may be
    a `PolicyFactory` (e.g. `policies.cost_aware()`), built once, on the first request.
    Batches: `generate_many` runs up to `batch_size` sequences per target forward, each with
    its own copy of the drafter (the drafter's `prepare` resets all per-sequence state).
    A `gate` lets rounds skip drafting where plain rounds measure faster (decode/gate.py).
    `bucketed_shapes` pads every verification forward to a few shapes (tokens, attention width,
    keys read), as a GPU capturing its forwards needs; on a CPU padding only costs
    (docs/design.md, "Capture-friendly shapes"). `coupled_drafts=False` makes a sampled
    generation's drafter draft greedily instead of with the verifier's noise (slower; for
    comparisons).
    """

    def __init__(self, target: LoadedModel, drafter: Drafter | None = None,
                 policy: Policy | PolicyFactory | None = None, gate: SpeculationGate | None = None,
                 bucketed_shapes: bool = False, coupled_drafts: bool = True) -> None:
        if (drafter is None) != (policy is None):
            raise GenerationInputError("a drafter needs a policy and a policy needs a drafter")
        if gate is not None and drafter is None:
            raise GenerationInputError("a speculation gate needs a drafter")
        self.gate = gate
        self.bucketed_shapes = bucketed_shapes
        self.coupled_drafts = coupled_drafts
        self.target = target
        self.drafter = drafter
        self._policy_factory = policy if policy is not None and is_policy_factory(policy) else None
        self.policy: Policy | None = None if self._policy_factory else policy  # type: ignore[assignment]

    def check_request(self, request: GenerationRequest) -> None:
        """Raise GenerationInputError if this request cannot run on this target."""
        prompt_ids, max_new_tokens = request.prompt_ids, request.max_new_tokens
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
        if request.stop and self.target.tokenizer is None:
            raise GenerationInputError("stop strings need the target's tokenizer.json")
        StopStrings(request.stop, str)  # validates the strings themselves

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop: Sequence[str] = ()) -> GenerationResult:
        """Exactly the target's continuation of `prompt_ids` (greedy, or sampled with a seed)."""
        [(_, result)] = self.generate_many([GenerationRequest(list(prompt_ids), max_new_tokens, sampling, stop)])
        return result

    @torch.inference_mode()
    def generate_many(self, requests: Sequence[GenerationRequest],
                      batch_size: int | None = None) -> Iterator[tuple[int, GenerationResult]]:
        """(request index, result) as each finishes: up to `batch_size` (default: all) rows
        decode together; a finished row's slot takes the next waiting request between rounds.
        Every result equals that request's single-sequence result."""
        for request in requests:
            self.check_request(request)
        if not requests:
            return
        slots = max(1, min(batch_size or len(requests), len(requests)))
        batch = self.open_batch(slots, max(len(r.prompt_ids) + r.max_new_tokens for r in requests),
                                max(r.max_new_tokens for r in requests))
        waiting = deque(enumerate(requests))
        while waiting or batch.running:
            while waiting and batch.free_slots:
                batch.add(*waiting.popleft())
            yield from batch.step()

    def open_batch(self, slots: int, max_total: int, max_new_tokens: int) -> "DecodeBatch":
        """A batch of `slots` rows that requests join and leave between rounds (continuous
        batching): `generate_many` and the server drive one. A joining request may need up
        to `max_total` positions (prompt + new tokens) and `max_new_tokens` new tokens."""
        return DecodeBatch(self, slots, max_total, max_new_tokens)

    def _ensure_policy(self, prompt_ids: list[int]) -> None:
        """Build a policy factory's policy on the first request (it may time the models on it)."""
        if self._policy_factory is not None and self.drafter is not None:
            self.policy, self._policy_factory = self._policy_factory(self.target, self.drafter, prompt_ids), None

    def _start(self, index: int, request: GenerationRequest, drafter: Drafter | None,
               cache: KVCache, drafter_cache: KVCache | None) -> _Sequence:
        """A joining request's sequence, its drafter prepared; `_prefill` fills its cache row."""
        tokenizer = self.target.tokenizer
        seq = _Sequence(index, request, drafter, cache, Sampler(request.sampling, self.target.config.vocab_size),
                        StopStrings(request.stop, tokenizer.decode) if request.stop else None,
                        frozenset(self.target.config.eos_token_ids), list(request.prompt_ids))
        seq.sampler.follow(request.prompt_ids, seq.generated)
        total = len(request.prompt_ids) + request.max_new_tokens
        if drafter_cache is not None:
            drafter.prepare(total, cache=drafter_cache)  # type: ignore[call-arg]
        elif drafter is not None:
            drafter.prepare(total)
        if drafter is not None:
            drafter.sample_with(seq.sampler if self.coupled_drafts else None)
        return seq

    def _prefill(self, joining: dict[int, _Sequence], cache: KVCache) -> None:
        """Write the joining rows' prompts (all tokens but the last) into their cache rows: one
        forward over the row's own cache for a single row, else one packed forward for all."""
        rows = {slot: seq for slot, seq in joining.items() if len(seq.committed) > 1}
        if not rows:
            return
        model, taps = self.target.model, self._taps
        seqs = list(rows.values())
        if len(seqs) == 1:
            out = model(torch.tensor([seqs[0].committed[:-1]], device=model.device), 0, seqs[0].cache,
                        logits_at=slice(0, 0), taps=taps)
            features = [out[1][0]] if taps else []
        else:
            ragged = Ragged.pack(list(rows), [0] * len(seqs), [seq.committed[:-1] for seq in seqs], model.device)
            out = model.forward_ragged(ragged, cache, logits_at=torch.zeros(0, dtype=torch.long, device=model.device),
                                       taps=taps)
            features = [out[1][o:o + n] for o, n in zip(ragged.offsets, ragged.lengths)] if taps else []
        for seq, row_features in zip(seqs, features or [None] * len(seqs)):
            seq.cache.length = len(seq.committed) - 1
            if row_features is not None:
                seq.drafter.add_context(0, row_features)  # type: ignore[union-attr]
            seq.stats.target_forwards += 1

    @property
    def _taps(self) -> tuple[int, ...]:
        """Target layers whose outputs the drafter reads (a DFlash drafter), else none."""
        return getattr(self.drafter, "target_layers", ())

    def _round(self, active: dict[int, _Sequence], cache: KVCache, drafters: list,
               shared: KVCache | None) -> None:
        """Draft for every active row (unless the gate says plain rounds are faster now),
        verify them in one forward, commit each row's tokens."""
        model = self.target.model
        gate = self.gate
        if gate is not None:  # what the gate needs to measure the round
            started = time.perf_counter()
            generated = sum(len(seq.generated) for seq in active.values())
            # a row's first round also feeds its prompt to its drafter: not a rate the gate should learn
            joined = any(seq.stats.rounds == 0 for seq in active.values())
        speculate = gate is None or gate.speculate(len(active))
        drafts: dict[int, tuple[list[int], list[float], int, float]] = {}
        if not speculate:
            drafts = {slot: ([], [], 0, 0.0) for slot in active}
        elif shared is not None and len(active) > 1:
            t0 = time.perf_counter()
            before = {slot: seq.drafter.forwards for slot, seq in active.items()}
            together = draft_together(drafters, self.policy,
                                      {slot: (seq.committed, seq.budget) for slot, seq in active.items()}, shared)
            share = (time.perf_counter() - t0) / len(active)  # the batch's drafting time, split evenly
            for slot, seq in active.items():
                drafts[slot] = (*together[slot], seq.drafter.forwards - before[slot], share)
        else:
            for slot, seq in active.items():
                t0 = time.perf_counter()
                passes_before = seq.drafter.forwards if seq.drafter else 0
                draft, confs = (draft_alone(seq.drafter, self.policy, seq.committed, seq.budget)
                                if seq.drafter is not None else ([], []))
                passes = (seq.drafter.forwards if seq.drafter else 0) - passes_before
                drafts[slot] = (draft, confs, passes, time.perf_counter() - t0)
        for slot, (draft, confs, passes, draft_s) in drafts.items():
            keep = self.policy.verify_count(confs) if self.policy is not None else 0
            drafts[slot] = (draft[:keep], confs[:keep], passes, draft_s)
        t1 = time.perf_counter()
        taps = self._taps
        if len(active) == 1 and not self.bucketed_shapes:  # alone: the single-sequence forward over its own cache row
            [(slot, seq)] = active.items()
            n = len(seq.committed)
            out = model(torch.tensor([[seq.committed[-1], *drafts[slot][0]]], device=model.device), n - 1, seq.cache,
                        taps=taps)
            logits, features = (out[0][0], out[1][0]) if taps else (out[0], None)
            spans = {slot: (0, logits.shape[0])}
        else:  # every active row in one packed forward over its cache row
            # bucketed: filler tokens go to the batch cache's last row, kept for them
            padding_row = cache.keys[0].shape[0] - 1 if self.bucketed_shapes else None
            ragged = Ragged.pack(list(active), [len(seq.committed) - 1 for seq in active.values()],
                                 [[seq.committed[-1], *drafts[slot][0]] for slot, seq in active.items()], model.device,
                                 padding_row=padding_row, capacity=cache.capacity)
            out = model.forward_ragged(ragged, cache, taps=taps)
            logits, features = out if taps else (out, None)
            spans = {slot: (o, o + n) for slot, o, n in zip(active, ragged.offsets, ragged.lengths)}
        rows = {slot: logits[lo:hi] for slot, (lo, hi) in spans.items()}
        penalized = {slot for slot, seq in active.items() if seq.sampler.params.penalized}
        for slot in penalized:  # each row after the draft prefix it verifies
            rows[slot] = active[slot].sampler.penalize(rows[slot], drafts[slot][0])
        greedy = [slot for slot, seq in active.items() if seq.sampler.params.greedy]
        picked = greedy_tokens(logits) if set(greedy) - penalized else []  # one host read for those rows
        choices = {slot: greedy_tokens(rows[slot]) if slot in penalized else picked[slice(*spans[slot])]
                   for slot in greedy}
        verify_s = time.perf_counter() - t1
        for slot, seq in active.items():
            draft, confs, passes, draft_s = drafts[slot]
            n = len(seq.committed)
            if slot in choices:
                accepted, next_token = accept_choices(choices[slot], draft)
            else:
                accepted, next_token = verify_draft(rows[slot][:len(draft) + 1], draft, seq.sampler, n)
            if self.policy is not None:
                self.policy.observe(confs, accepted)
            seq.cache.length = n + accepted
            if features is not None:  # the drafter's context grows by the newly cached positions
                lo = spans[slot][0]
                seq.drafter.add_context(n - 1, features[lo:lo + accepted + 1])
            seq.stats.target_forwards += 1
            seq.stats.draft_s += draft_s
            seq.stats.verify_s += verify_s
            seq.stats.record(RoundStats(len(draft), accepted, passes, confs))
            seq.commit((*draft[:accepted], next_token))
        if gate is not None and not joined:
            gate.record(len(active), speculate, max(sum(len(seq.generated) for seq in active.values()) - generated, 0),
                        time.perf_counter() - started)


class DecodeBatch:
    """Rows decoding together, one target forward per round; requests join a free slot and
    leave (finished or cancelled) between rounds. Built by `SpeculativeEngine.open_batch`."""

    def __init__(self, engine: SpeculativeEngine, slots: int, max_total: int, max_new_tokens: int) -> None:
        if slots < 1 or max_new_tokens < 1 or max_total < max_new_tokens:
            raise GenerationInputError(f"a batch needs >= 1 slot and room for >= 1 new token, got {slots} slots, "
                                       f"{max_total} positions and {max_new_tokens} new tokens")
        self.engine = engine
        self.slots = slots
        self.max_total = max_total
        self.max_new_tokens = max_new_tokens
        self.cache = engine.target.model.new_cache(max_total, batch=slots + engine.bucketed_shapes)
        drafter = engine.drafter
        self.drafters = [drafter] + [copy.copy(drafter) for _ in range(slots - 1)]
        # drafters that batch their passes share one cache, a row per slot (room for padding too)
        self.shared = (drafter.model.new_cache(drafter.batch_capacity(max_total), batch=slots)
                       if slots > 1 and getattr(drafter, "batchable", False) else None)
        self.active: dict[int, _Sequence] = {}  # slot -> sequence
        self.joining: dict[int, _Sequence] = {}  # added since the last step: prefilled together by it

    @property
    def running(self) -> int:
        return len(self.active)

    @property
    def free_slots(self) -> int:
        return self.slots - len(self.active)

    def add(self, index: int, request: GenerationRequest) -> None:
        """Give `request` (known to the caller as `index`) a free slot; the next `step`
        prefills every request added since the last one in one forward, then decodes them."""
        self.engine.check_request(request)
        if not self.free_slots:
            raise GenerationInputError("the batch has no free slot")
        if len(request.prompt_ids) + request.max_new_tokens > self.max_total or request.max_new_tokens > self.max_new_tokens:
            raise GenerationInputError(f"this batch holds at most {self.max_total} positions and {self.max_new_tokens} "
                                       "new tokens per request")
        self.engine._ensure_policy(request.prompt_ids)
        slot = next(s for s in range(self.slots) if s not in self.active)
        self.active[slot] = self.joining[slot] = self.engine._start(
            index, request, self.drafters[slot], self.cache.row(slot),
            self.shared.row(slot) if self.shared is not None else None)

    def cancel(self, index: int) -> bool:
        """Drop the request known as `index` (its slot is free at once); False if not running."""
        for slot, seq in self.active.items():
            if seq.index == index:
                del self.active[slot]
                self.joining.pop(slot, None)
                return True
        return False

    def generated(self) -> dict[int, list[int]]:
        """Each running request's tokens so far, by index (the engine's own lists: read only).
        A stop string found later can still cut the tail of a list."""
        return {seq.index: seq.generated for seq in self.active.values()}

    def step(self) -> list[tuple[int, GenerationResult]]:
        """One round for every running row; (index, result) of the rows that finished in it."""
        if not self.active:
            return []
        self.engine._prefill(self.joining, self.cache)
        self.joining = {}
        self.engine._round(self.active, self.cache, self.drafters, self.shared)
        done = [slot for slot, seq in self.active.items() if seq.finished]
        return [(seq.index, seq.result(self.engine.target.tokenizer)) for seq in (self.active.pop(s) for s in done)]
