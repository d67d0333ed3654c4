"""Drafter models that borrow the target's embedding and output head (DFlash, EAGLE-3)."""

from __future__ import annotations

import torch
from torch import nn

from failfast.errors import IncompatibleModelsError


class BorrowsTargetParts(nn.Module):
    """The target's embedding and head, attached by `attach` and never saved or trained with
    the drafter (not submodules); dtype and device are those of the drafter's `fc`."""

    fc: nn.Linear
    kind = "target-feature"  # named in errors

    def __init__(self) -> None:
        super().__init__()
        self._target: tuple[nn.Embedding, nn.Module] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def attach(self, embed_tokens: nn.Embedding, lm_head: nn.Module) -> None:
        """Use the target's embedding and output head (the caller matches their dtype)."""
        self._target = (embed_tokens, lm_head)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._parts()[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._parts()[1]

    def _parts(self) -> tuple[nn.Embedding, nn.Module]:
        if self._target is None:
            raise IncompatibleModelsError(f"the {self.kind} drafter has no target attached "
                                          f"({type(self).__name__}.attach)")
        return self._target
