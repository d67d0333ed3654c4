"""An autoregressive drafter: a small causal LM proposing one token per forward pass."""

from __future__ import annotations

import torch

from failfast.drafters.base import CausalCacheDrafter, ChainDrafter, ModelDrafter
from failfast.model.kv_cache import KVCache
from failfast.model.ragged import Ragged


class ARDrafter(ChainDrafter, CausalCacheDrafter, ModelDrafter):
    """Greedy drafting with a KV cache; the cache keeps whatever prefix was verified.

    Batches (docs/design.md, "Batching"): each row's copy drafts into its row of one shared
    cache (`prepare(..., cache=shared.row(slot))`), and `draft_rows` advances several rows by
    one token in a single ragged forward, exactly as `draft(1)` would for each.
    """

    batchable = True

    def _advance(self, logits: torch.Tensor) -> tuple[int, float]:
        """Take the prediction after the pending tokens (whose K/V are now cached)."""
        self.cache_ids.extend(self._pending)
        self.forwards += 1
        [tok], [conf] = self.picks(logits[None], [len(self.cache_ids)])
        self._pending = [tok]
        return tok, conf

    def _next(self) -> tuple[int, float]:
        logits = self.model(self._tensor(self._pending), self.cache.length, self.cache, logits_at=slice(-1, None),
                            head_weight=self.head_weight)
        return self._advance(logits[0, -1])

    def _greedy_chain(self, count: int) -> tuple[list[int], list[float]] | None:
        if (chain := self.model.greedy_chain(self._pending, count, self.cache, self.head_weight, self.vocab_limit,
                                             self.vocab_list)) is None:
            return None
        tokens, confs = chain
        fed = self._pending + tokens[:-1]  # the steps' inputs, now cached
        self.cache_ids.extend(fed)
        self.cache.length += len(fed)
        self._pending = tokens[-1:]
        self.forwards += count
        return tokens, confs

    @staticmethod
    def draft_rows(drafters: list["ARDrafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """One draft token for each slot in `wants`, in one packed forward over those slots'
        rows of `shared` (`drafters[slot]` drafts into `shared.row(slot)`): each row feeds its
        pending tokens (after a round, its accepted tokens and bonus; a joining row, its prompt)."""
        model = drafters[next(iter(wants))].model
        slots = list(wants)
        ragged = Ragged.pack(slots, [drafters[s].cache.length for s in slots], [drafters[s]._pending for s in slots],
                             model.device)
        last = [o + n - 1 for o, n in zip(ragged.offsets, ragged.lengths)]
        logits = model.forward_ragged(ragged, shared, logits_at=torch.tensor(last, device=model.device),
                                      head_weight=drafters[slots[0]].head_weight)
        out: dict[int, tuple[list[int], list[float]]] = {}
        for slot, row_logits in zip(slots, logits):
            d = drafters[slot]
            d.cache.length += len(d._pending)
            tok, conf = d._advance(row_logits)
            out[slot] = ([tok], [conf])
        return out
