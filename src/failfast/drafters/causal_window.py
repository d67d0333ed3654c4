"""Causal windows: several draft tokens per forward from a mask-token drafter whose known
tokens attend causally (docs/design.md, "Causal windows").

A pass forwards [pending known tokens, count - 1 masks]: the last known token's output
predicts the first draft token, as an AR drafter's does, and the d-th mask's output the token
after the d-th draft token (token shift). Every position attends to all positions before it
and none after, so the known tokens' K/V are exactly an AR cache: they stay cached while
verification keeps them and are rolled back otherwise, and no block is ever recomputed. The
masks' K/V are scratch that the next pass overwrites; a pass that continues a draft feeds
the tokens drafted so far as known tokens. Any mask-token drafter can draft this way (all
modes are lossless: verification decides); one trained for it (`failfast train
causal-windows`) says so in its config.json (`"failfast_denoise": "causal"`), and that
makes it its default mode.
"""

from __future__ import annotations

from typing import Sequence

import torch

from failfast.decode.policies import FailFastDefaults
from failfast.drafters.base import CausalCacheDrafter, ModelDrafter
from failfast.errors import IncompatibleModelsError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache
from failfast.model.ragged import Ragged

CAUSAL_WINDOWS = "causal"  # the denoising mode's name (--denoise) and the config.json value that asks for it


class CausalWindowDrafter(CausalCacheDrafter, ModelDrafter):
    """A window's masks sit where its draft tokens will, so a request's cache needs no more
    than an AR drafter's. Batches (docs/design.md, "Batching"): each row's copy drafts into its
    row of one shared cache, and `draft_rows` runs several rows' windows in one packed forward,
    each the window it would run alone."""

    batchable = True

    def __init__(self, loaded: LoadedModel, vocab_limit: int, draft_vocab: Sequence[int] | None = None) -> None:
        if loaded.config.mask_token_id is None:
            raise IncompatibleModelsError(f"{loaded.path} has no mask token (config.json mask_token_id): it cannot "
                                          "draft causal windows")
        super().__init__(loaded, vocab_limit, banned=(loaded.config.mask_token_id,), draft_vocab=draft_vocab)
        self.mask_id = loaded.config.mask_token_id
        # tau 0.6 and windows of four (three masks, as the embedded drafter was trained), by
        # measurement (README, "Choosing the drafting defaults")
        self.failfast_defaults = FailFastDefaults(tau=0.6, chunk=4)

    def _window(self, count: int) -> list[int]:
        return self._pending + [self.mask_id] * (count - 1)

    def _logit_rows(self, count: int) -> list[int]:
        """Where in a window the outputs predicting its `count` draft tokens are: the last
        known token, then each mask."""
        return list(range(len(self._pending) - 1, len(self._pending) + count - 1))

    def _take(self, logits: torch.Tensor, count: int) -> tuple[list[int], list[float]]:
        """The window's draft tokens from its logits [count, V]; the pending tokens' K/V now
        count as cached and the drafted tokens become pending (fed if the draft goes on)."""
        self.cache.length += len(self._pending)
        self.cache_ids.extend(self._pending)
        self.forwards += 1
        known = len(self.cache_ids)
        tokens, confs = self.picks(logits, list(range(known, known + count)))
        self._pending = tokens
        return tokens, confs

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        logits = self.model(self._tensor(self._window(count)), self.cache.length, self.cache, commit=False,
                            logits_at=self._logit_rows(count), head_weight=self.head_weight)
        return self._take(logits[0], count)

    @staticmethod
    def draft_rows(drafters: list["CausalWindowDrafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """`draft(wants[slot])` for every slot in `wants`, the windows in one packed forward
        over those slots' rows of `shared` (`drafters[slot]` drafts into `shared.row(slot)`)."""
        slots = list(wants)
        first = drafters[slots[0]]
        ragged = Ragged.pack(slots, [drafters[s].cache.length for s in slots],
                             [drafters[s]._window(wants[s]) for s in slots], first.model.device)
        at = [offset + i for s, offset in zip(slots, ragged.offsets) for i in drafters[s]._logit_rows(wants[s])]
        logits = first.model.forward_ragged(ragged, shared, logits_at=torch.tensor(at, device=first.model.device),
                                            head_weight=first.head_weight)
        return {s: drafters[s]._take(part, wants[s])
                for s, part in zip(slots, logits.split([wants[s] for s in slots]))}
