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


from failfast.drafters.target_features import TargetFeatureDrafter
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.transformer import linear

MAX_PASSES = 4  # windows of up to 4 blocks: 63 drafted tokens with blocks of 16, past FailFast's N_max of 60


class DFlashDrafter(TargetFeatureDrafter):
    """Drafts blocks from target features; the target's embedding and head are shared."""

    kind = "DFlash"

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

    def _run_pass(self) -> None:
        masks = self.block_size - 1 if len(self.window) == 1 else self.block_size
        tokens = self._tensor(self.window + [self.mask_id] * masks)
        hidden = self.model.draft_pass(tokens, self.cache.length, self.cache)
        out = hidden[0, -masks:]
        tok, conf = self.pick(self.model.lm_head(out) if self.head_weight is None else linear(out, self.head_weight))
        self.window += tok.tolist()
        self.window_confs += conf.tolist()
        self.passes += 1
        self.forwards += 1

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        """Up to `count` more tokens; fewer only when `max_passes` passes are spent."""
        while len(self.window_confs) - self.handed < count and self.passes < self.max_passes:
            self._run_pass()
        lo = self.handed
        self.handed = min(lo + count, len(self.window_confs))
        return self.window[1 + lo:1 + self.handed], self.window_confs[lo:self.handed]
