"""Drafter models that borrow the target's embedding and output head (DFlash, EAGLE-3)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from failfast.errors import IncompatibleModelsError
from failfast.model import cpu_kernels
from failfast.model.kv_cache import KVCache
from failfast.model.tiled import TiledWeight
from failfast.model.transformer import Linear, kept_layer_stack


def packed_places(rows: Sequence[int], starts: Sequence[int], lengths: Sequence[int],
                  device: torch.device) -> Tensor:
    """The kernels' places [3, N] of packed spans: span i's `lengths[i]` tokens at positions
    starts[i].. of cache row rows[i], each reading keys up to its span's end."""
    spans = list(zip(rows, starts, lengths))
    return torch.tensor([[r for r, _, n in spans for _ in range(n)],
                         [p for _, s, n in spans for p in range(s, s + n)],
                         [s + n for _, s, n in spans for _ in range(n)]], device=device)


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

    def whole_call(self, parts: tuple, tokens: list[int], places: Tensor, end: int, cache: KVCache,
                   logits_at: list[int], taps: Sequence[int] = (), **extra: Tensor | None) -> list[Tensor]:
        """[logits at `logits_at`, tapped outputs] of packed tokens at `places` (positions below
        `end`) in one `stack_forward` call: the drafter's kept layers (its `_kernel_weights`
        just read), the target's embedding and the head of `parts` (`whole_call_parts`), the
        drafter's final norm; `extra`: stack_forward's `hidden` and `embedded_norm`."""
        embedding, head = parts
        cos, signed_sin = self.rotary.tables(end, torch.float32)  # type: ignore[union-attr]
        norm = self.norm  # type: ignore[union-attr]
        return cpu_kernels.kernels().stack_forward(  # type: ignore[union-attr]
            kept_layer_stack(self), tokens, 1, places, 0, 0, 0, embedding, cos, signed_sin, cache.keys, cache.values,
            norm.weight, norm.eps, head.tiles, head.weight.shape[0], logits_at, list(taps), **extra)

    def _parts(self) -> tuple[nn.Embedding, nn.Module]:
        if self._target is None:
            raise IncompatibleModelsError(f"the {self.kind} drafter has no target attached "
                                          f"({type(self).__name__}.attach)")
        return self._target
