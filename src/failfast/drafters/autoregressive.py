"""An autoregressive drafter: a small causal LM proposing one token per forward pass."""

from __future__ import annotations

from failfast.drafters.base import ModelDrafter, common_prefix_len


class ARDrafter(ModelDrafter):
    """Greedy drafting with a KV cache; the cache keeps whatever prefix was verified."""

    def prepare(self, total_len: int) -> None:
        self._allocate(total_len + 1, total_len)
        self._pending: list[int] = []

    def begin(self, committed: list[int]) -> None:
        keep = min(common_prefix_len(self.cache_ids, committed), len(committed) - 1)
        self._rollback(keep)
        self._pending = committed[keep:]  # tokens to feed before the next prediction

    def draft(self, count: int) -> tuple[list[int], list[float]]:
        tokens: list[int] = []
        confs: list[float] = []
        for _ in range(count):
            logits = self.model(self._tensor(self._pending), self.cache.length, self.cache, logits_at=slice(-1, None))
            self.cache_ids.extend(self._pending)
            self.forwards += 1
            tok, conf = self.pick(logits[0, -1])
            tokens.append(int(tok))
            confs.append(float(conf))
            self._pending = [tokens[-1]]
        return tokens, confs
