"""An autoregressive drafter: a small causal LM proposing one token per forward pass."""

from __future__ import annotations

import torch

from failfast.drafters.base import ModelDrafter, common_prefix_len
from failfast.model.kv_cache import KVCache


class ARDrafter(ModelDrafter):
    """Greedy drafting with a KV cache; the cache keeps whatever prefix was verified.

    Batches (docs/design.md, "Batching"): each row's copy drafts into its row of one shared
    cache (`prepare(..., cache=shared.row(slot))`), and `draft_rows` advances several rows by
    one token in a single ragged forward, exactly as `draft(1)` would for each.
    """

    batchable = True
    batch_width = 8  # rows with more pending tokens (a prompt after joining) step alone

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        self._allocate(total_len + 1, total_len, cache)
        self._pending: list[int] = []

    def begin(self, committed: list[int]) -> None:
        keep = min(common_prefix_len(self.cache_ids, committed), len(committed) - 1)
        self._rollback(keep)
        self._pending = committed[keep:]  # tokens to feed before the next prediction

    def _advance(self, logits: torch.Tensor) -> tuple[int, float]:
        """Take the prediction after the pending tokens (whose K/V are now cached)."""
        self.cache_ids.extend(self._pending)
        self.forwards += 1
        tok, conf = self.pick(logits)
        self._pending = [int(tok)]
        return int(tok), float(conf)

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        confs: list[float] = []
        for _ in range(count):
            logits = self.model(self._tensor(self._pending), self.cache.length, self.cache, logits_at=slice(-1, None),
                                head_weight=self.head_weight)
            tok, conf = self._advance(logits[0, -1])
            tokens.append(tok)
            confs.append(conf)
        return tokens, confs

    def batch_capacity(self, positions: int) -> int:
        """Positions per row of a batch's shared cache: room for a padded step past `positions`."""
        return positions + 1 + self.batch_width

    @staticmethod
    def draft_rows(drafters: list["ARDrafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """One draft token for each slot in `wants`, in one forward over every slot of
        `shared` (`drafters[slot]` drafts into `shared.row(slot)`). Other slots compute
        throwaway tokens at and past their cached length, which they overwrite before reading.
        A row with more than `batch_width` pending tokens (its prompt, after joining) steps
        alone, so that one long row does not widen every row's forward."""
        out: dict[int, tuple[list[int], list[float]]] = {}
        for slot in [s for s in wants if len(drafters[s]._pending) > ARDrafter.batch_width]:
            out[slot] = drafters[slot].draft(1)
        wanted = [slot for slot in wants if slot not in out]
        if not wanted:
            return out
        width = max(len(drafters[slot]._pending) for slot in wanted)
        tokens = [[0] * width for _ in drafters]
        for slot in wanted:
            tokens[slot][:len(drafters[slot]._pending)] = drafters[slot]._pending
        model = drafters[wanted[0]].model
        logits = model.forward_rows(torch.tensor(tokens, device=model.device), [d.cache.length for d in drafters], shared,
                                    head_weight=drafters[wanted[0]].head_weight)
        for slot in wanted:
            d = drafters[slot]
            d.cache.length += len(d._pending)
            tok, conf = d._advance(logits[slot, len(d._pending) - 1])
            out[slot] = ([tok], [conf])
        return out
