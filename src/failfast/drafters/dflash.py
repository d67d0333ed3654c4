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

import torch
from torch import Tensor

from failfast.drafters.base import ModelDrafter
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.transformer import linear

MAX_PASSES = 4  # windows of up to 4 blocks: 63 drafted tokens with blocks of 16, past FailFast's N_max of 60


class DFlashDrafter(ModelDrafter):
    """Drafts blocks from target features; the target's embedding and head are shared."""

    def __init__(self, loaded: LoadedModel, target: LoadedModel, vocab_limit: int,
                 draft_vocab: Sequence[int] | None = None, max_passes: int = MAX_PASSES) -> None:
        cfg, tcfg = loaded.config, target.config
        if not cfg.is_dflash:
            raise IncompatibleModelsError(f"{loaded.path} is not a DFlash drafter (config.json needs "
                                          "architectures [\"DFlashDraftModel\"] and dflash_config)")
        if cfg.hidden_size != tcfg.hidden_size:
            raise IncompatibleModelsError(f"DFlash drafter {loaded.path} has hidden size {cfg.hidden_size}; it shares "
                                          f"the target's embedding and head, whose hidden size is {tcfg.hidden_size}")
        if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
            raise IncompatibleModelsError(f"DFlash drafter {loaded.path} reads target layers {list(cfg.target_layer_ids)}; "
                                          f"the target has {tcfg.num_hidden_layers} layers")
        if max_passes < 1:
            raise IncompatibleModelsError(f"a DFlash drafter needs at least one pass per round, got {max_passes}")
        model = loaded.model
        dtype = model.dtype
        embed, head = target.model.model.embed_tokens, target.model.lm_head
        if embed.weight.dtype != dtype:  # a drafter in another dtype than the target: its own copies
            embed = torch.nn.Embedding.from_pretrained(embed.weight.detach().to(dtype), freeze=True)
            head = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=False, dtype=dtype,
                                   device=head.weight.device).requires_grad_(False)
            head.weight.copy_(target.model.lm_head.weight.detach())
        model.attach(embed, head)
        super().__init__(loaded, vocab_limit, banned=(cfg.mask_token_id,), draft_vocab=draft_vocab)
        self.target_layers: tuple[int, ...] = cfg.target_layer_ids
        self.mask_id = cfg.mask_token_id
        self.block_size = cfg.block_size
        self.max_passes = max_passes
        self._pending: list[tuple[int, Tensor]] = []

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        self._allocate(total_len + self.max_passes * self.block_size, total_len, cache)
        self._pending = []
        self.window: list[int] = []

    def add_context(self, start: int, features: Tensor) -> None:
        """Target features [T, F] of committed positions start..start+T-1; projected into the
        cache at the next `begin` (inside the drafting time). A start below what is cached
        rolls the context back there first."""
        self._pending.append((start, features))

    def _write_pending(self) -> None:
        for start, features in self._pending:
            if start < self.cache.length:
                self.cache.rollback(start)
            self.model.write_context(features[None], start, self.cache)
        self._pending = []

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
