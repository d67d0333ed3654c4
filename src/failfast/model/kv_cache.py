"""Preallocated KV cache indexed by absolute position; rollback is setting `length`."""

from __future__ import annotations

import torch


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
        batch prefills and decodes alone through it, and joins batched forwards (`write_at`)."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[index:index + 1] for k in self.keys]
        view.values = [v[index:index + 1] for v in self.values]
        view.capacity, view.length = self.capacity, 0
        return view

    def rows(self, index: list[int]) -> "KVCache":
        """Rows `index` of this batch cache, for a forward over only those rows: entry b of the
        forward writes and reads row index[b] in place (`write_at`)."""
        return _RowSubset(self, index)

    def _row_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        """The cache row of each of a forward's `batch` rows."""
        return torch.arange(batch, device=device)

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 read_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store K/V [B, H, T, D] of row b at positions[b] ([B, T], any per-row offsets) and
        return every row's keys/values up to `read_end` (a batched forward masks per row)."""
        rows = self._row_ids(k.shape[0], k.device)[:, None].expand_as(positions)
        self.keys[layer][rows, :, positions] = k.transpose(1, 2)
        self.values[layer][rows, :, positions] = v.transpose(1, 2)
        return self._read(layer, read_end)

    def _read(self, layer: int, read_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][:, :, :read_end], self.values[layer][:, :, :read_end]

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


class _RowSubset(KVCache):
    """`KVCache.rows`: a view of some rows of a batch cache (reads gather those rows)."""

    def __init__(self, parent: KVCache, index: list[int]) -> None:
        self.keys, self.values, self.capacity, self.length = parent.keys, parent.values, parent.capacity, 0
        self.index = torch.tensor(index, device=parent.keys[0].device)

    def _row_ids(self, batch: int, device: torch.device) -> torch.Tensor:
        if batch != self.index.shape[0]:
            raise ValueError(f"a forward of {batch} rows over a view of {self.index.shape[0]} cache rows")
        return self.index

    def _read(self, layer: int, read_end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][self.index, :, :read_end], self.values[layer][self.index, :, :read_end]
