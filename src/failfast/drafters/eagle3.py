"""An EAGLE-3-style chain drafter under any policy (docs/design.md, "EAGLE-3").

After every verification the engine hands the drafter the target's features at the newly
committed positions (`add_context`). At the next `begin` they are fused, and every committed
slot j (fused feature j, committed token j+1) whose K/V are not cached yet is projected into
the drafter's cache. The round's chain starts at the last slot, n-2 for n committed tokens
(the last feature with the last committed token), and each step feeds its own output and
the token it drafted to the next: one drafted token per step, each with its confidence.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from failfast.decode.policies import FailFastDefaults
from failfast.drafters.base import ChainDrafter
from failfast.drafters.target_features import TargetFeatureDrafter
from failfast.errors import GenerationInputError, IncompatibleModelsError
from failfast.model import LoadedModel
from failfast.model.kv_cache import KVCache


class Eagle3Drafter(ChainDrafter, TargetFeatureDrafter):
    """Drafts a chain from target features; the target's embedding and head are shared.

    Batches (docs/design.md, "Batching"): each row's copy keeps its slots in its row of one
    shared cache, and `draft_rows` advances several rows' chains by one step in one forward.
    """

    batchable = True
    # one token per pass: stop at the first unsure pair (README, "Choosing the drafting defaults")
    failfast_defaults = FailFastDefaults(tau=0.8, chunk=2)

    def __init__(self, loaded: LoadedModel, target: LoadedModel, vocab_limit: int,
                 draft_vocab: Sequence[int] | None = None) -> None:
        if not loaded.config.is_eagle3:
            raise IncompatibleModelsError(f"{loaded.path} is not an EAGLE-3 drafter (config.json needs "
                                          "architectures [\"Eagle3DraftModel\"] and eagle_config)")
        super().__init__(loaded, target, vocab_limit, draft_vocab)

    def prepare(self, total_len: int, cache: KVCache | None = None) -> None:
        self._allocate(total_len + 1, total_len, cache)
        self._pending = []
        self.fused = torch.zeros(total_len + 1, self.loaded.config.hidden_size, dtype=self.model.dtype,
                                 device=self.model.device)
        self.features_end = 0  # fused features held for positions [0, features_end)
        self.true_slots = 0    # cached slots built from target features (draft slots follow them)

    def begin(self, committed: list[int]) -> None:
        n = len(committed)
        low = self.true_slots
        for start, features in self._take_pending():
            self.fused[start:start + features.shape[0]] = self.model.fuse(features)
            self.features_end = start + features.shape[0]
            low = min(low, start)
        if self.features_end != n - 1:
            raise GenerationInputError(f"the EAGLE-3 drafter holds target features for {self.features_end} positions; "
                                       f"a round after {n} committed tokens needs {n - 1}")
        self.cache.rollback(low)  # drops last round's draft slots and any slot whose feature was replaced
        last = max(n - 2, 0)
        if last > low:
            self.model.write_context(self._tensor(committed[low + 1:last + 1]), self.fused[None, low:last], low,
                                     self.cache)
        self.true_slots = last
        # the chain's first slot: the last feature with the last committed token (no feature
        # exists before a one-token prompt's first round: zeros stand in, drafts are verified)
        self.hidden = self.fused[None, None, n - 2] if n >= 2 else torch.zeros_like(self.fused[None, None, 0])
        self.next_token = committed[-1]
        self.next_position = n  # absolute position of the next draft token

    def _take(self, output: Tensor, logits: Tensor) -> tuple[int, float]:
        """The token a step's output [1, 1, hidden] predicts (its logits [1, V']); it and the
        output feed the next step."""
        self.hidden = output
        [self.next_token], [conf] = self.picks(logits, [self.next_position])
        self.next_position += 1
        self.forwards += 1
        return self.next_token, conf

    def _next(self) -> tuple[int, float]:
        out, logits = self.model.step_logits(self._tensor([self.next_token]), self.hidden, [0], [self.cache.length],
                                             self.cache, self.head_weight)
        self.cache.length += 1
        return self._take(out, logits)

    def _greedy_chain(self, count: int) -> tuple[list[int], list[float]] | None:
        if (chain := self.model.greedy_chain(self.next_token, self.hidden, count, self.cache, self.head_weight,
                                             self.vocab_limit, self.vocab_list)) is None:
            return None
        tokens, confs, self.hidden = chain
        self.cache.length += count
        self.next_token = tokens[-1]
        self.next_position += count
        self.forwards += count
        return tokens, confs

    @staticmethod
    def draft_rows(drafters: list["Eagle3Drafter"], wants: dict[int, int],
                   shared: KVCache) -> dict[int, tuple[list[int], list[float]]]:
        """One draft token for each slot in `wants`: the rows' chain steps in one forward over
        their rows of `shared` (`drafters[slot]` drafts into `shared.row(slot)`)."""
        slots = list(wants)
        first = drafters[slots[0]]
        outputs, logits = first.model.step_logits(
            torch.tensor([[drafters[s].next_token] for s in slots], device=first.model.device),
            torch.cat([drafters[s].hidden for s in slots]), slots, [drafters[s].cache.length for s in slots], shared,
            first.head_weight)
        out = {}
        for i, slot in enumerate(slots):
            d = drafters[slot]
            d.cache.length += 1
            tok, conf = d._take(outputs[i:i + 1], logits[i:i + 1])
            out[slot] = ([tok], [conf])
        return out
