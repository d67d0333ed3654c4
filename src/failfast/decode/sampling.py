"""The sampler shared by plain decoding and verification, and the acceptance rule.

Sampled tokens use Gumbel-max noise keyed by (seed, absolute position): the token drawn
at a position depends only on the prefix, the seed and the position, so speculative
decoding reproduces plain sampling token for token. Greedy is temperature 0.

A drafter that samples may read the same noise (coupled drafting, docs/design.md,
"Engine"): it proposes argmax(its log-probabilities + the position's noise), which equals
the target's draw whenever the two distributions agree closely enough, so sampled drafts
are accepted far more often than greedy ones. The target's draw never depends on the draft.

Penalties (repetition, presence, frequency) change the logits by the tokens before a position;
verification applies them to each of its rows with the draft prefix that row follows, so a
penalized generation is also the same token for token (docs/design.md, "Penalties").
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from failfast.errors import GenerationInputError
from failfast.model import cpu_kernels

_GOLDEN = 0x9E3779B97F4A7C15
_MASK63 = (1 << 63) - 1
PENALTY_LIMIT = 1e4  # beyond it a penalty only overflows (inf * 0 is NaN), it cannot mean more


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    # vLLM's and Hugging Face's: a token seen in the prompt or the output so far has its logit
    # divided by this when positive, multiplied when negative (1 disables it)
    repetition_penalty: float = 1.0
    # OpenAI's: subtracted once from the logit of every token the output holds / once per occurrence
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            try:
                finite = math.isfinite(value)
            except (TypeError, OverflowError):  # not a number, or an integer too large for a float
                finite = False
            if not finite:
                raise GenerationInputError(f"{name} must be a finite number, got {value!r:.40}")
        if not self.temperature >= 0:
            raise GenerationInputError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise GenerationInputError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise GenerationInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 1 / PENALTY_LIMIT <= self.repetition_penalty <= PENALTY_LIMIT:
            raise GenerationInputError(f"repetition_penalty must be in [{1 / PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}] "
                                       f"(1 disables it), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not abs(getattr(self, name)) <= PENALTY_LIMIT:
                raise GenerationInputError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], "
                                           f"got {getattr(self, name)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def greedy_tokens(logits: Tensor) -> list[int]:
    """The argmax token of each row of logits [..., V] (the first one on ties, as `argmax`).
    Float32 rows on an AVX-512 CPU take one kernel call (`row_picks`: PyTorch's argmax and the
    host read cost ~60-110 us right after a forward has streamed the weights through the
    caches). Other rows on a CPU are widened to float32 first (16-bit ones), exactly: PyTorch's CPU argmax over
    bfloat16 is a slow path (one 8,192-wide row: 31 us against 11 us widened; 16 rows: 240
    against 70 us, 2 threads)."""
    if (picks := row_picks(logits, None, confidence=False)) is not None:
        return picks[0]
    if logits.device.type == "cpu":
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return logits.argmax(-1).tolist()


def row_picks(logits: Tensor, limit: int | None, *, confidence: bool) -> tuple[list[int], list[float]] | None:
    """Each row of logits [N, V]: the argmax among the first `limit` columns (None: all) and,
    with `confidence`, its softmax probability, as host lists in one kernel call
    (`cpu_kernels.row_picks`); None where the kernel does not serve (no kernels, or not a
    contiguous float32 CPU matrix)."""
    kernels = cpu_kernels.kernels()
    return None if kernels is None else kernels.row_picks(logits, limit, confidence)


def token_columns(tokens: Iterable[int], width: int, columns: Sequence[int] | None = None) -> dict[int, int]:
    """token -> its column among logits that cover the first `width` ids, or the sorted ids
    `columns` (a draft vocabulary); tokens without a column are left out."""
    if columns is None:
        return {t: t for t in sorted(tokens) if 0 <= t < width}
    found = ((t, bisect_left(columns, t)) for t in sorted(tokens))
    return {t: i for t, i in found if i < len(columns) and columns[i] == t}


def apply_penalties(logits: Tensor, params: SamplingParams, prompt_ids: Collection[int],
                    output_counts: Mapping[int, int], draft: Sequence[int] = (),
                    columns: Sequence[int] | None = None, prompt_index: Tensor | None = None) -> Tensor:
    """Penalized logits [R, V'] (a float32-or-wider copy) for rows that follow a prompt holding
    `prompt_ids`, an output with `output_counts` (token -> occurrences) and `draft[:r]` (row r
    of a verification). The logits cover the token ids `columns` (a draft vocabulary, sorted)
    or the first V'; `prompt_index` (the prompt tokens' columns, `token_columns`) saves
    finding them again. Only the columns of tokens seen so far change, and the prompt's in
    one vectorized step, so the cost follows the tokens generated, not the vocabulary or the
    prompt. Elementwise per row, so a row comes out the same whether it is verified alone or
    among others."""
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    if not params.penalized:
        return scores
    rows, width = scores.shape
    device, p = scores.device, params.repetition_penalty

    def repeat_penalized(x: Tensor) -> Tensor:
        return torch.where(x > 0, x / p, x * p)

    if p != 1:  # every row has seen every prompt token
        if prompt_index is None:
            prompt_index = torch.tensor(list(token_columns(prompt_ids, width, columns).values()), dtype=torch.long)
        index = prompt_index.to(device)
        scores[:, index] = repeat_penalized(scores[:, index])
    draft = list(draft[:rows - 1])
    at = token_columns(set(output_counts).union(draft), width, columns)
    if not at:
        return scores
    order = {t: j for j, t in enumerate(at)}
    counts = torch.tensor([[float(output_counts.get(t, 0)) for t in at]]).repeat(rows, 1)
    for r, token in enumerate(draft):  # row r follows the first r draft tokens
        if token in order:
            counts[r + 1:, order[token]] += 1
    index = torch.tensor(list(at.values()), device=device)
    sub, counts = scores[:, index], counts.to(device, scores.dtype)
    if p != 1:  # tokens seen in the output (or the draft) only, not already penalized as prompt tokens
        first_seen = (counts > 0) & ~torch.tensor([t in prompt_ids for t in at], device=device)
        sub = torch.where(first_seen, repeat_penalized(sub), sub)
    if params.frequency_penalty:
        sub = sub - params.frequency_penalty * counts
    if params.presence_penalty:
        sub = sub - params.presence_penalty * (counts > 0).to(sub.dtype)
    scores[:, index] = sub
    return scores


def processed_logprobs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Log-probabilities after temperature, top-k and top-p ([..., V]; removed tokens -inf)."""
    scores = logits.double() / params.temperature
    if params.top_k and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=True)
        probs = sorted_scores.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= params.top_p  # never drops the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.log_softmax(-1)


def gumbel_noise(seed: int, position: int, vocab: int, device: torch.device) -> Tensor:
    """Standard Gumbel noise that depends only on (seed, position)."""
    gen = torch.Generator(device="cpu").manual_seed((seed * _GOLDEN + position) & _MASK63)
    u = torch.rand(vocab, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    return (-torch.log(-torch.log(u))).to(device)


class Sampler:
    """Chooses the target's token at given absolute positions, one sequence's worth.

    `vocab`: the target's vocabulary size, which a coupled drafter's noise must be drawn
    over. Each position's noise is drawn once and kept until the verifier has chosen past it,
    so the drafter and the verifier share it.
    """

    def __init__(self, params: SamplingParams | None = None, vocab: int | None = None) -> None:
        self.params = params or SamplingParams()
        self.vocab = vocab
        self._noise: dict[int, Tensor] = {}
        self.follow((), [])

    def follow(self, prompt: Sequence[int], output: list[int]) -> None:
        """The sequence's prompt and its output (the live list the engine appends to), which
        penalties read; the output's counts are kept up to date as it grows."""
        self._prompt_ids = frozenset(prompt) if self.params.penalized else frozenset()
        self._prompt_index: dict[tuple[int, int], Tensor] = {}  # (logits width, id of columns) -> prompt columns
        self._output = output
        self._counts: Counter[int] = Counter()
        self._counted = 0

    def penalize(self, logits: Tensor, draft: Sequence[int] = (), columns: Sequence[int] | None = None) -> Tensor:
        """`apply_penalties` after this sequence's tokens (logits unchanged without penalties)."""
        if not self.params.penalized:
            return logits
        if len(self._output) < self._counted:  # cut short (a stop string): count afresh
            self._counts, self._counted = Counter(), 0
        self._counts.update(self._output[self._counted:])
        self._counted = len(self._output)
        key = (logits.shape[-1], id(columns))  # a drafter's draft vocabulary lives as long as the generation
        if key not in self._prompt_index:
            found = token_columns(self._prompt_ids, logits.shape[-1], columns)
            self._prompt_index[key] = torch.tensor(list(found.values()), dtype=torch.long, device=logits.device)
        return apply_penalties(logits, self.params, self._prompt_ids, self._counts, draft, columns,
                               self._prompt_index[key])

    def noise(self, position: int, vocab: int, device: torch.device) -> Tensor:
        """The Gumbel noise [vocab] of an absolute position."""
        g = self._noise.get(position)
        if g is None or g.shape[-1] != vocab or g.device != device:
            g = self._noise[position] = gumbel_noise(self.params.seed, position, vocab, device)
        return g

    def choose(self, logits: Tensor, position: int) -> int:
        """Token for one position from its logits [V]."""
        if self.params.greedy:
            return greedy_tokens(logits[None])[0]
        for committed in [p for p in self._noise if p < position]:  # positions before it are final
            del self._noise[committed]
        logp = processed_logprobs(logits, self.params)
        return int((logp + self.noise(position, logp.shape[-1], logp.device)).argmax())

    def draft_choices(self, logits: Tensor, positions: Sequence[int],
                      vocab_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Coupled drafting: tokens [N] for a drafter's logits [N, V'] at absolute `positions`,
        each the argmax of its processed log-probabilities plus the noise the verifier will
        draw there, and their probabilities under the drafter. The logits cover the first V'
        token ids, or the ids `vocab_ids` (a draft vocabulary)."""
        if self.vocab is None:
            raise ValueError("coupled drafting needs the sampler's vocabulary size (the target's)")
        logp = processed_logprobs(logits, self.params)
        noise = torch.stack([self.noise(p, self.vocab, logits.device) for p in positions])
        noise = noise[:, vocab_ids] if vocab_ids is not None else noise[:, :logits.shape[-1]]
        index = (logp + noise).argmax(-1)
        conf = logp.gather(-1, index[:, None])[:, 0].exp().float()
        return (vocab_ids[index] if vocab_ids is not None else index), conf


def accept_choices(choices: list[int], draft: list[int]) -> tuple[int, int]:
    """Greedy acceptance from the target's argmax at each of the k+1 positions: (a, y) as in
    `verify_draft`."""
    for a, d in enumerate(draft):
        if d != choices[a]:
            return a, choices[a]
    return len(draft), choices[len(draft)]


def verify_draft(logits: Tensor, draft: list[int], sampler: Sampler, first_position: int) -> tuple[int, int]:
    """Accept-while-equal over target logits [k+1, V] for draft d1..dk.

    Returns (a, y): the number of accepted draft tokens and the target's token at the
    first position not covered by an accepted draft (a correction, or a bonus if a == k).
    Exact for any drafter: the target's choice is computed independently of the draft.
    """
    if sampler.params.greedy:
        return accept_choices(greedy_tokens(logits), draft)
    for a in range(len(draft) + 1):
        y = sampler.choose(logits[a], first_position + a)
        if a == len(draft) or draft[a] != y:
            return a, y
    raise AssertionError("unreachable")
