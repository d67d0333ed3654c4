"""What every drafter offers the engine, and helpers the drafters share."""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from failfast.decode.sampling import Sampler, row_picks
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.packed import pack_weight


class Drafter(Protocol):
    """Proposes tokens after a committed sequence, a few at a time.

    The engine calls `prepare` once per generation, then `sample_with` with that
    generation's sampler, `begin` at the start of every round with the committed sequence,
    then `draft` as often as the policy asks for more.
    """

    forwards: int  # model forward passes so far (cumulative)

    def prepare(self, total_len: int) -> None: ...

    def sample_with(self, sampler: Sampler | None) -> None:
        """Draft this generation's tokens for `sampler` (coupled drafting when it samples,
        `decode/sampling.py`); None or a greedy sampler: greedy drafts."""

    def begin(self, committed: list[int]) -> None: ...

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        """The next `count` draft tokens and each one's confidence (its probability)."""


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelDrafter:
    """Shared state of drafters that run one of our transformers: model, cache and the
    token ids whose K/V the cache holds (so verified prefixes are reused across rounds)."""

    def __init__(self, loaded: LoadedModel, vocab_limit: int, banned: tuple[int, ...] = (),
                 draft_vocab: Sequence[int] | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.vocab_limit = vocab_limit
        self.banned = [t for t in banned if t < vocab_limit]
        # A reduced draft vocabulary (docs/design.md, "Draft vocabulary"): the output head runs
        # over these rows only, and drafts can hold only these tokens.
        self.vocab_ids: Tensor | None = None
        self.vocab_list: list[int] | None = None  # the same ids on the host (penalties look them up)
        self.head_weight: Tensor | None = None
        if draft_vocab is not None:
            ids = sorted({t for t in draft_vocab if 0 <= t < vocab_limit} - set(self.banned))
            if not ids:
                raise IncompatibleModelsError("the draft vocabulary holds none of the target's tokens")
            self.vocab_list = ids
            self.vocab_ids = torch.tensor(ids, device=self.model.device)
            self.head_weight = pack_weight(self.model.lm_head.weight.detach()[self.vocab_ids].contiguous())
        self.forwards = 0
        self.cache = self.model.new_cache(1)
        self.cache_ids: list[int] = []
        self.sampler: Sampler | None = None

    def sample_with(self, sampler: Sampler | None) -> None:
        self.sampler = sampler

    def _allocate(self, capacity: int, needed_positions: int, cache: KVCache | None = None) -> None:
        """A fresh cache of `capacity`, or the given one (a row of a batch's shared drafter cache)."""
        limit = self.loaded.config.max_position_embeddings
        if needed_positions > limit:
            raise GenerationInputError(
                f"the drafter's context is {limit} tokens; this request needs {needed_positions}")
        if cache is not None and cache.capacity < capacity:
            raise ValueError(f"a drafter cache of {cache.capacity} positions is given; {capacity} are needed")
        self.cache = cache if cache is not None else self.model.new_cache(capacity)
        self.cache.length = 0
        self.cache_ids = []

    def _rollback(self, length: int) -> None:
        self.cache.rollback(length)
        del self.cache_ids[length:]

    def pick(self, logits: Tensor, positions: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Draft tokens and their probabilities for logits [V] or [N, V] over the target's
        vocabulary, or over the draft vocabulary (logits from `head_weight`), at absolute
        `positions` (one per row): greedy, or with the verifier's noise when this
        generation samples (coupled drafting); penalized as the verifier penalizes after the
        committed tokens (not the ones drafted this round)."""
        if self.vocab_ids is None:
            logits = logits[..., : self.vocab_limit].float()
            if self.banned:
                logits = logits.clone()
                logits[..., self.banned] = float("-inf")
        if self.sampler is not None and self.sampler.params.penalized:  # as the verifier will, after the committed tokens
            logits = self.sampler.penalize(logits.reshape(-1, logits.shape[-1]), columns=self.vocab_list).reshape(logits.shape)
        if self.sampler is not None and not self.sampler.params.greedy:
            tok, conf = self.sampler.draft_choices(logits.reshape(-1, logits.shape[-1]), positions, self.vocab_ids)
            return tok.reshape(logits.shape[:-1]), conf.reshape(logits.shape[:-1])
        conf, index = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        return (self.vocab_ids[index] if self.vocab_ids is not None else index), conf

    @property
    def plain_greedy(self) -> bool:
        """Whether a pick is the argmax of the logits' columns: greedy and unpenalized, with no
        banned token outside a draft vocabulary (which holds none). Such picks, and chains of
        them, can run in one kernel call."""
        greedy = self.sampler is None or (self.sampler.params.greedy and not self.sampler.params.penalized)
        return greedy and (self.vocab_ids is not None or not self.banned)

    def picks(self, logits: Tensor, positions: Sequence[int]) -> tuple[list[int], list[float]]:
        """`pick` for logits [N, V] as host lists. A greedy, unpenalized pick of float32 logits
        on an AVX-512 CPU is one kernel call (`sampling.row_picks`) instead of a softmax, a max
        and host reads: its confidences round like the kernel's exp, not PyTorch's softmax,
        which may change a draft but never what is committed."""
        limit = logits.shape[-1] if self.vocab_ids is not None else min(self.vocab_limit, logits.shape[-1])
        if self.plain_greedy and (found := row_picks(logits, limit, confidence=True)) is not None:
            ids, confs = found
            return ([self.vocab_list[i] for i in ids] if self.vocab_list is not None else ids), confs
        tok, conf = self.pick(logits, positions)
        return tok.reshape(-1).tolist(), conf.reshape(-1).tolist()

    def _tensor(self, ids: list[int]) -> Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.model.device)


class CausalCacheDrafter:
    """Drafters whose cache holds the causal K/V of the tokens fed so far (AR, causal
    windows): a round keeps the prefix verification kept and feeds the rest (its pending
    tokens) before its next forward; a request needs its positions plus the one being drafted."""

    cache: KVCache
    cache_ids: list[int]
    _allocate: Callable[..., None]  # ModelDrafter's
    _rollback: Callable[[int], None]

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        self._allocate(total_len + 1, total_len, cache)
        self._pending: list[int] = []

    def begin(self, committed: list[int]) -> None:
        keep = min(common_prefix_len(self.cache_ids, committed), len(committed) - 1)
        self._rollback(keep)
        self._pending = committed[keep:]  # tokens to feed before the next prediction

    def batch_capacity(self, positions: int) -> int:
        """Positions per row of a batch's shared cache: a row's, plus the one being drafted."""
        return positions + 1


class ChainDrafter:
    """Drafters that propose one token per forward (AR, EAGLE-3): `draft` is `count` steps of
    `_next`, greedy ones in one kernel call where `_greedy_chain` serves (docs/design.md,
    "Greedy chains in one call"), and a batch's shared cache needs a row's positions plus the
    step being drafted."""

    plain_greedy: bool  # ModelDrafter's

    def _next(self) -> tuple[int, float]:
        """Run one forward; the next draft token and its confidence."""
        raise NotImplementedError

    def _greedy_chain(self, count: int) -> tuple[list[int], list[float]] | None:
        """`count` plain greedy steps in one kernel call, the drafter's state advanced as the
        steps one by one would leave it; None where that call does not serve."""
        return None

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        if count > 1 and self.plain_greedy and (chained := self._greedy_chain(count)) is not None:
            return chained
        tokens: list[int] = []
        confs: list[float] = []
        for _ in range(count):
            tok, conf = self._next()
            tokens.append(tok)
            confs.append(conf)
        return tokens, confs

    def batch_capacity(self, positions: int) -> int:
        """Positions per row of a batch's shared cache: as many as one row needs."""
        return positions + 1
