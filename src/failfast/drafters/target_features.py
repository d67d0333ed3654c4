"""What drafters that read the target's features share (DFlash, EAGLE-3): the target's
embedding and head attached in the drafter's dtype, checks that the drafter fits the target,
and features of committed positions queued by the engine until the next round."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from failfast.drafters.base import ModelDrafter
from failfast.errors import IncompatibleModelsError
from failfast.model import LoadedModel


class TargetFeatureDrafter(ModelDrafter):
    """Base of drafters whose model has `attach(embed, head)` and reads target layers
    `target_layers` (the engine taps them in every verification forward)."""

    def __init__(self, loaded: LoadedModel, target: LoadedModel, vocab_limit: int,
                 draft_vocab: Sequence[int] | None = None, banned: tuple[int, ...] = ()) -> None:
        cfg, tcfg, kind = loaded.config, target.config, loaded.model.kind
        if cfg.hidden_size != tcfg.hidden_size:
            raise IncompatibleModelsError(f"{kind} drafter {loaded.path} has hidden size {cfg.hidden_size}; it "
                                          f"shares the target's embedding and head, whose hidden size is {tcfg.hidden_size}")
        if max(cfg.target_layer_ids) >= tcfg.num_hidden_layers:
            raise IncompatibleModelsError(f"{kind} drafter {loaded.path} reads target layers "
                                          f"{list(cfg.target_layer_ids)}; the target has {tcfg.num_hidden_layers} layers")
        model = loaded.model
        dtype = model.dtype
        embed, head = target.model.model.embed_tokens, target.model.lm_head
        if embed.weight.dtype != dtype:  # a drafter in another dtype than the target: its own copies
            embed = torch.nn.Embedding.from_pretrained(embed.weight.detach().to(dtype), freeze=True)
            head = torch.nn.Linear(head.weight.shape[1], head.weight.shape[0], bias=False, dtype=dtype,
                                   device=head.weight.device).requires_grad_(False)
            head.weight.copy_(target.model.lm_head.weight.detach())
        model.attach(embed, head)
        super().__init__(loaded, vocab_limit, banned=banned, draft_vocab=draft_vocab)
        self.target_layers: tuple[int, ...] = cfg.target_layer_ids
        self._pending: list[tuple[int, Tensor]] = []

    def add_context(self, start: int, features: Tensor) -> None:
        """Target features [T, F] of committed positions start..start+T-1, used at the next
        `begin` (inside the drafting time). A start below what is held replaces from there."""
        self._pending.append((start, features))

    def _take_pending(self) -> list[tuple[int, Tensor]]:
        pending, self._pending = self._pending, []
        return pending
