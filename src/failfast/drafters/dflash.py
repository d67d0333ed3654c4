"""A target-conditioned block drafter (DFlash-style) under any policy (docs/design.md,
"Target-conditioned drafting").

After every verification the engine hands the drafter the target's features at the newly
committed positions (`add_context`); they become context K/V in the drafter's cache, which
therefore only ever holds committed positions. A round's first pass drafts `block_size - 1`
tokens from `[last committed token, masks]`. When the policy asks for more, an extension
pass runs `[last committed token, every drafted token, block_size masks]`: the drafter was
trained on such windows (known prefix, one block of masks), so a confident block grows by
a block per pass, up to `max_passes` passes per round.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor


from failfast.decode.policies import FailFastDefaults
from failfast.drafters.target_features import TargetFeatureDrafter
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.transformer import linear

MAX_PASSES = 4  # windows of up to 4 blocks: 63 drafted tokens with blocks of 16, past FailFast's N_max of 60


class DFlashDrafter(TargetFeatureDrafter):
    """Drafts blocks from target features; the target's embedding and head are shared.

    Batches (docs/design.md, "Batching"): each row's copy keeps its context in its row of one
    shared cache, and `draft_rows` runs the passes of several rows in one forward.
    """

    batchable = True

    def __init__(self, loaded: LoadedModel, target: LoadedModel, vocab_limit: int,
                 draft_vocab: Sequence[int] | None = None, max_passes: int = MAX_PASSES) -> None:
        cfg = loaded.config
        if not cfg.is_dflash:
            raise IncompatibleModelsError(f"{loaded.path} is not a DFlash drafter (config.json needs "
                                          "architectures [\"DFlashDraftModel\"] and dflash_config)")
        if max_passes < 1:
            raise IncompatibleModelsError(f"a DFlash drafter needs at least one pass per round, got {max_passes}")
        super().__init__(loaded, target, vocab_limit, draft_vocab, banned=(cfg.mask_token_id,))
        self.mask_id = cfg.mask_token_id
        self.block_size = cfg.block_size
        self.tokens_per_pass = cfg.block_size - 1  # of a round's first pass
        # verify what is likely accepted: 6 of a block's 15, more while confident (README,
        # "Choosing the drafting defaults")
        self.failfast_defaults = FailFastDefaults(tau=0.8, chunk=min(6, self.tokens_per_pass))
        self.max_passes = max_passes

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        self._allocate(total_len + self.max_passes * self.block_size, total_len, cache)
        self._pending = []
        self.window: list[int] = []

    def _write_pending(self) -> None:
        """Project queued features into the context cache (a start below it rolls it back)."""
        for start, features in self._take_pending():
            if start < self.cache.length:
                self.cache.rollback(start)
            self.model.write_context(features[None], start, self.cache)

    def begin(self, committed: list[int]) -> None:
        self._write_pending()
        if self.cache.length != len(committed) - 1:
            raise GenerationInputError(f"the DFlash drafter holds target features for {self.cache.length} positions; "
                                       f"a round after {len(committed)} committed tokens needs {len(committed) - 1}")
        self.window = [committed[-1]]  # known tokens of the block: the last committed one, then drafts
        self.window_confs: list[float] = []
        self.handed = 0
        self.passes = 0

    def _window(self) -> tuple[list[int], int]:
        """The next pass's block (known tokens, then masks) and its number of masks."""
        masks = self.block_size - 1 if len(self.window) == 1 else self.block_size
        return self.window + [self.mask_id] * masks, masks

    def _take_pass(self, hidden: Tensor, masks: int) -> None:
        """Decode a pass's final hidden states [W, hidden] at its masks."""
        out = hidden[-masks:]
        self._take_logits(self.model.lm_head(out) if self.head_weight is None else linear(out, self.head_weight))

    def _take_logits(self, logits: Tensor) -> None:
        """Decode a pass from its logits at its masks [masks, V']."""
        first = self.cache.length + len(self.window)  # window token w sits at position cache.length + w
        tokens, confs = self.picks(logits, range(first, first + logits.shape[0]))
        self.window += tokens
        self.window_confs += confs
        self.passes += 1
        self.forwards += 1

    def _run_pass(self) -> None:
        window, masks = self._window()
        whole = self.model.pass_logits([window], [0], [self.cache.length], self.cache, [masks], self.head_weight)
        if whole is not None:  # the pass and its head in one kernel call
            self._take_logits(whole[0])
        else:
            self._take_pass(self.model.draft_pass(self._tensor(window), self.cache.length, self.cache)[0], masks)

    def _drafted_unhanded(self) -> int:
        return len(self.window_confs) - self.handed

    def _hand(self, count: int) -> tuple[list[int], list[float]]:
        lo = self.handed
        self.handed = min(lo + count, len(self.window_confs))
        return self.window[1 + lo:1 + self.handed], self.window_confs[lo:self.handed]

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        """Up to `count` more tokens; fewer only when `max_passes` passes are spent."""
        while self._drafted_unhanded() < count and self.passes < self.max_passes:
            self._run_pass()
        return self._hand(count)

    def batch_capacity(self, positions: int) -> int:
        """Positions per row of a batch's shared cache: as many as one row needs."""
        return positions + self.max_passes * self.block_size

    @staticmethod
    def draft_rows(drafters: list["DFlashDrafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """Draft tokens (up to wants[slot]; none once a row's passes are spent) for every slot
        in `wants`: rows whose drafted tokens are all handed out run their next pass together
        in one forward over their rows of `shared`, each the pass it would run alone."""
        passing = [slot for slot in wants if drafters[slot]._drafted_unhanded() == 0
                   and drafters[slot].passes < drafters[slot].max_passes]
        if len(passing) == 1:
            drafters[passing[0]]._run_pass()
        elif passing:
            plans = [drafters[slot]._window() for slot in passing]
            first = drafters[passing[0]]
            windows, starts = [w for w, _ in plans], [drafters[s].cache.length for s in passing]
            whole = first.model.pass_logits(windows, passing, starts, shared, [m for _, m in plans], first.head_weight)
            if whole is not None:  # the rows' passes and their heads in one kernel call
                for slot, logits in zip(passing, whole):
                    drafters[slot]._take_logits(logits)
            else:
                for slot, part, (_, masks) in zip(passing, first.model.draft_passes(windows, passing, starts, shared),
                                                  plans):
                    drafters[slot]._take_pass(part, masks)
        return {slot: drafters[slot]._hand(wants[slot]) for slot in wants}
