"""Block-diffusion drafter with Fast-dLLM v2 semantics (docs/design.md, "Block-diffusion drafting").

Blocks of B tokens are aligned from position 0. The cache holds K/V of complete blocks
only. The current block (known tail + masks) is denoised window by window, left to right;
each pass unmasks every position whose confidence exceeds the unmask threshold and always
the single most confident one. Logits for position j are read at j - 1 (token shift); a
block's first token comes from the last position of the previous block.

Denoising passes (docs/design.md, "Block-diffusion drafting"): "full-block" forwards the
whole current block every pass (exact). "sub-block" (Fast-dLLM v2's block cache) forwards
only the positions whose token changed since their scratch K/V were written, through the
end of the active sub-block, and reads the rest of the block's K/V from the scratch region
of the cache. "prefix" does the same but attends only up to the active sub-block's end (the
masks after it carry no token) and keeps the scratch K/V across rounds while the block
stays, so a round's first pass is a sub-block, not the whole block. "sliding" (default) is
"prefix" with a window that starts at the first undecoded position instead of at a
sub-block boundary and holds as many masks as the engine asks for (the policy's chunk; a
`sub_block_size` given explicitly fixes it): each pass drafts one chunk, conditioned on the
chunks drafted before it, where an aligned sub-block holds only what is left of it. All but
"full-block" are approximations for drafting, which verification makes harmless.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from failfast.decode.policies import FailFastDefaults
from failfast.drafters.base import ModelDrafter, common_prefix_len
from failfast.errors import IncompatibleModelsError, PolicyError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.ragged import Ragged


DENOISE_MODES = ("sliding", "prefix", "sub-block", "full-block")
# Chosen by measurement (README "Choosing the drafting defaults"): "prefix" drafted the same
# tokens per target forward as "sub-block" with less drafting time, and "sliding" windows of
# one chunk draft about as many as "prefix" in 15% fewer passes.
DEFAULT_DENOISE = "sliding"
_PREFIX_ATTENTION = ("sliding", "prefix")  # modes that attend only up to the window's end
# Chosen by measurement on the embedded models (README "Choosing the drafting defaults"): one
# pass per window (threshold 0) was faster than the paper's 0.05 on every held-out run.
DEFAULT_UNMASK_THRESHOLD = 0.0


@dataclass(frozen=True)
class _Pass:
    """One denoising pass: block positions [lo, hi) forwarded, the masked positions it
    predicts, the end of their window, and the block position its attention reads up to."""

    lo: int
    hi: int
    masked: list[int]
    end: int
    context_end: int

    @property
    def logit_indices(self) -> list[int]:
        """Where among the pass's tokens each masked position's logits are read (token shift)."""
        return [j - 1 - self.lo for j in self.masked]


class BlockDiffusionDrafter(ModelDrafter):
    """Batches (docs/design.md, "Batching"): each row's copy drafts into its row of one shared
    cache, and `draft_rows` runs the denoising passes that several rows need in one forward."""

    batchable = True

    def __init__(self, loaded: LoadedModel, vocab_limit: int, unmask_threshold: float = DEFAULT_UNMASK_THRESHOLD,
                 denoise: str = DEFAULT_DENOISE, sub_block_size: int | None = None,
                 draft_vocab: Sequence[int] | None = None) -> None:
        cfg = loaded.config
        if cfg.mask_token_id is None or cfg.block_size is None:
            raise IncompatibleModelsError(
                f"{loaded.path} is not a block-diffusion drafter: config.json needs mask_token_id "
                "and bd_size (or model_type Fast_dLLM_Qwen)")
        if not 0 <= unmask_threshold <= 1:
            raise PolicyError(f"unmask threshold must be in [0, 1], got {unmask_threshold}")
        if denoise not in DENOISE_MODES:
            raise PolicyError(f"denoising pass must be one of {', '.join(DENOISE_MODES)}, got {denoise!r}")
        sub = sub_block_size or cfg.sub_block_size or cfg.block_size
        if denoise == "sliding" and not 1 <= sub <= cfg.block_size:
            raise PolicyError(f"a sliding window must hold 1 to {cfg.block_size} tokens (the block size), got {sub}")
        if denoise != "sliding" and (not 1 <= sub <= cfg.block_size or cfg.block_size % sub):
            raise PolicyError(f"sub-block size must divide the block size {cfg.block_size}, got {sub}")
        super().__init__(loaded, vocab_limit, banned=(cfg.mask_token_id,), draft_vocab=draft_vocab)
        self.mask_id = cfg.mask_token_id
        self.block_size = cfg.block_size
        self.sub_block_size = sub
        self.window = sub_block_size if denoise == "sliding" else None  # None: the size of each request
        # chunks of 4: a sliding pass drafts one; an aligned pass drafts a sub-block of 8 and a
        # confident chunk takes the rest without another pass (README, "Choosing the drafting defaults")
        self.failfast_defaults = FailFastDefaults(tau=0.6, chunk=min(4, sub))
        self.unmask_threshold = unmask_threshold
        self.denoise = denoise
        self.boundary: Tensor | None = None  # logits at cache.length - 1: predicts the next block's first token
        self.scratch_base = -1

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        b = self.block_size
        self._allocate(-(-total_len // b) * b + b, total_len, cache)
        self.boundary = None
        self.scratch_base = -1  # a new cache holds no scratch K/V

    def begin(self, committed: list[int]) -> None:
        b = self.block_size
        n = len(committed)
        full = n // b * b
        keep = min(common_prefix_len(self.cache_ids, committed) // b * b, full)
        if keep != self.cache.length:  # the cached blocks change: scratch K/V saw other context
            self.scratch_base = -1
        if keep < self.cache.length:
            self._rollback(keep)
            self.boundary = None
        if n == full and keep == full and self.boundary is None:
            keep -= b  # the first token of the new block needs the previous block's last logits
            self._rollback(keep)
        if full > keep:
            self._commit(committed[keep:full])
        self.block = committed[full:] + [self.mask_id] * (full + b - n)
        self.block_confs: list[float] = [1.0] * (n - full) + [0.0] * (full + b - n)
        self.handed = n - full  # block index of the next token to hand to the engine
        self.ready = n - full   # block index up to which tokens are decoded (window complete)
        if self.denoise not in _PREFIX_ATTENTION or self.scratch_base != self.cache.length:
            self._new_block_scratch()

    def _new_block_scratch(self) -> None:
        # the token whose K/V the cache's scratch region holds at each block position (None: none
        # yet), for the block that starts at cache position `scratch_base`
        self.scratch_ids: list[int | None] = [None] * self.block_size
        self.scratch_base = self.cache.length

    def _commit(self, tokens: list[int]) -> None:
        """Forward complete, known blocks into the cache; keep the boundary logits."""
        start = self.cache.length
        logits = self.model(self._tensor(tokens), start, self.cache, block_size=self.block_size,
                            logits_at=slice(-1, None), head_weight=self.head_weight)
        self.cache_ids.extend(tokens)
        self.boundary = logits[0, -1]
        self.forwards += 1

    def _next_pass(self, wanted: int) -> _Pass | None:
        """The denoising pass needed before the next token can be handed out (`wanted`: how many
        the engine still asks for: a sliding window's size), or None when one is decoded
        already. Completes a handed-out block first (a forward that caches it)."""
        if self.handed < self.ready:
            return None
        if self.handed == self.block_size:  # block complete: cache it, start the next
            self._commit(self.block)
            self.block = [self.mask_id] * self.block_size
            self.block_confs = [0.0] * self.block_size
            self.handed = self.ready = 0
            self._new_block_scratch()
        s, first = self.sub_block_size, self.ready
        if first == 0 and self.block[0] == self.mask_id:  # the block's first token, AR-style, from the boundary
            [self.block[0]], [self.block_confs[0]] = self.picks(self.boundary[None], [self.cache.length])
        if self.denoise == "sliding":
            end = min(first + (self.window or max(wanted, 1)), self.block_size)
        else:
            end = min((first // s + 1) * s, self.block_size)
        masked = [j for j in range(first, end) if self.block[j] == self.mask_id]
        if not masked:
            self.ready = end
            return None
        lo, hi = self._pass_range(masked, end)
        return _Pass(lo, hi, masked, end, hi if self.denoise in _PREFIX_ATTENTION else self.block_size)

    def _apply_pass(self, plan: _Pass, logits: Tensor) -> None:
        """Unmask from a pass's logits [len(plan.masked), V]: every position above the
        threshold and always the most confident one; the window is decoded when none is left."""
        self.scratch_ids[plan.lo:plan.hi] = self.block[plan.lo:plan.hi]
        self.forwards += 1
        tokens, confs = self.picks(logits, [self.cache.length + j for j in plan.masked])
        surest = max(range(len(confs)), key=confs.__getitem__)  # the first of equals, as argmax
        for i, (j, t, c) in enumerate(zip(plan.masked, tokens, confs)):
            if c > self.unmask_threshold or i == surest:
                self.block[j], self.block_confs[j] = t, c
        if all(self.block[j] != self.mask_id for j in plan.masked):
            self.ready = plan.end

    def _run_pass(self, plan: _Pass) -> None:
        base = self.cache.length
        logits = self.model(self._tensor(self.block[plan.lo:plan.hi]), base + plan.lo, self.cache,
                            block_size=self.block_size, commit=False, context_end=base + plan.context_end,
                            logits_at=plan.logit_indices,
                            head_weight=self.head_weight)
        self._apply_pass(plan, logits[0])

    def _pass_range(self, masked: list[int], end: int) -> tuple[int, int]:
        """Block positions [lo, hi) a denoising pass computes; the rest of the block (of its
        first `end` positions in the prefix modes) is read from scratch K/V. A full-block pass, or a
        sub-block mode's first pass of a block, covers everything."""
        b = self.block_size
        if self.denoise == "full-block" or (self.denoise == "sub-block" and None in self.scratch_ids[end:]):
            return 0, b
        stale = [p for p in range(end) if self.scratch_ids[p] != self.block[p]]  # never written (None) is stale
        return min(stale + [j - 1 for j in masked]), end

    def _hand(self, count: int) -> tuple[list[int], list[float]]:
        """Up to `count` decoded tokens not handed out yet, and their confidences."""
        take = min(count, self.ready - self.handed)
        tokens = self.block[self.handed:self.handed + take]
        confs = self.block_confs[self.handed:self.handed + take]
        self.handed += take
        return tokens, confs

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        confs: list[float] = []
        while len(tokens) < count:
            if (plan := self._next_pass(count - len(tokens))) is not None:
                self._run_pass(plan)
                continue
            new, new_confs = self._hand(count - len(tokens))
            tokens += new
            confs += new_confs
        return tokens, confs

    def batch_capacity(self, positions: int) -> int:
        """Positions per row of a batch's shared cache: as many as one row needs."""
        b = self.block_size
        return -(-positions // b) * b + b

    @staticmethod
    def draft_rows(drafters: list["BlockDiffusionDrafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """Some draft tokens (1 to wants[slot]) for every slot in `wants`: rows with decoded
        tokens hand them out, and the rows that need a denoising pass run theirs together in
        one forward over their rows of `shared` (`drafters[slot]` drafts into
        `shared.row(slot)`), each pass the one it would run alone."""
        out: dict[int, tuple[list[int], list[float]]] = {}
        while len(out) < len(wants):
            plans = {}
            for slot in wants:
                if slot in out:
                    continue
                if (plan := drafters[slot]._next_pass(wants[slot])) is None:
                    out[slot] = drafters[slot]._hand(wants[slot])
                else:
                    plans[slot] = plan
            if len(plans) == 1:
                [(slot, plan)] = plans.items()
                drafters[slot]._run_pass(plan)
            elif plans:
                BlockDiffusionDrafter._run_passes(drafters, plans, shared)
        return out

    @staticmethod
    def _run_passes(drafters: list["BlockDiffusionDrafter"], plans: dict[int, _Pass], shared: KVCache) -> None:
        """Several rows' passes in one packed forward, each row block-causal up to its own
        context end."""
        first = drafters[next(iter(plans))]
        model = first.model
        ragged = Ragged.pack(list(plans), [drafters[slot].cache.length + plan.lo for slot, plan in plans.items()],
                             [drafters[slot].block[plan.lo:plan.hi] for slot, plan in plans.items()], model.device)
        context_ends = [drafters[slot].cache.length + plan.context_end for slot, plan in plans.items()]
        at = [offset + i for offset, plan in zip(ragged.offsets, plans.values()) for i in plan.logit_indices]
        logits = model.forward_ragged(ragged, shared, block_size=first.block_size, context_ends=context_ends,
                                      logits_at=torch.tensor(at, device=model.device), head_weight=first.head_weight)
        for part, (slot, plan) in zip(logits.split([len(p.masked) for p in plans.values()]), plans.items()):
            drafters[slot]._apply_pass(plan, part)
