"""Preallocated KV cache indexed by absolute position; rollback is setting `length`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from failfast.model.ragged import Ragged


class KVCache:
    """Per-layer key/value buffers `[batch, kv_heads, capacity, head_dim]` plus a valid length.

    A forward pass writes K/V for positions [start, start + T) in place. Only positions
    below `length` count as cached, so rejected drafts are discarded by lowering `length`
    and never copied.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str, batch: int = 1) -> None:
        shape = (batch, kv_heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0  # of a one-row cache; a batch's rows keep theirs in `row(i)` views

    def row(self, index: int) -> "KVCache":
        """A one-row cache sharing row `index`'s storage, with its own length: a sequence of a
        batch prefills and decodes alone through it, and joins batched forwards (`write_ragged`)."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[index:index + 1] for k in self.keys]
        view.values = [v[index:index + 1] for v in self.values]
        view.capacity, view.length = self.capacity, 0
        return view

    def write_ragged(self, layer: int, ragged: "Ragged", k: torch.Tensor, v: torch.Tensor,
                     read_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store packed K/V [N, H, D] of a ragged forward at each token's cache row and
        position, and return its rows' keys/values [rows, H, read_end, D] (the batch's own
        storage when the forward covers every row in order, else a gathered copy)."""
        self.keys[layer][ragged.cache_row_of, :, ragged.positions[0]] = k
        self.values[layer][ragged.cache_row_of, :, ragged.positions[0]] = v
        keys, values = self.keys[layer][:, :, :read_end], self.values[layer][:, :, :read_end]
        if ragged.rows != list(range(keys.shape[0])):
            index = torch.tensor(ragged.rows, device=keys.device)
            keys, values = keys[index], values[index]
        return keys, values

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of length {self.length} to {length}")
        self.length = length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor,
              context_end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V at [start, start+T) and return all keys/values up to start+T, or up to
        `context_end` when the caller also reads scratch K/V written past it earlier."""
        end = start + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        read = max(end, context_end or 0)
        return self.keys[layer][:, :, :read], self.values[layer][:, :, :read]

