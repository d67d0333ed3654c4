"""Drafter models that borrow the target's embedding and output head (DFlash, EAGLE-3)."""

from __future__ import annotations

import torch
from torch import nn

from failfast.errors import IncompatibleModelsError
from failfast.model.tiled import TiledWeight
from failfast.model.transformer import Linear


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

    def whole_call_parts(self, head_weight: "TiledWeight | torch.Tensor | None") -> tuple | None:
        """(embedding, tiled head) for a whole drafting pass or step in one kernel call
        (`cpu_kernels.stack_forward`): `head_weight` (a draft vocabulary's rows) or the
        target's head as tiles; None where that call does not serve (an untiled or biased head,
        an embedding or final norm not in float32). Read every call: the target's parts are not
        the drafter's, so its kept plan does not watch them."""
        head, embedding = head_weight, self.embed_tokens.weight
        if head is None and isinstance(self.lm_head, Linear) and self.lm_head.bias is None:
            head = self.lm_head.fresh_packed()
        norm = self.norm.weight  # type: ignore[union-attr]
        if not (isinstance(head, TiledWeight) and embedding.dtype == norm.dtype == torch.float32
                and embedding.is_contiguous()):
            return None
        return embedding, head

    def _parts(self) -> tuple[nn.Embedding, nn.Module]:
        if self._target is None:
            raise IncompatibleModelsError(f"the {self.kind} drafter has no target attached "
                                          f"({type(self).__name__}.attach)")
        return self._target
