"""Several cache rows' tokens packed into one forward (docs/design.md, "Batching").

Rows of a batch carry different numbers of tokens (a verification of 3 drafted tokens next
to one of 60). Padding them to the longest row makes every linear layer and the output head
pay for the padding; packing them makes each pay for real tokens only. Only attention,
which reads each row's own cache row, runs on a padded [rows, width] layout, built and
undone by indexing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch
from torch import Tensor

from failfast.model.shapes import token_bucket


@dataclass(frozen=True)
class Ragged:
    """Row i (cache row `rows[i]`) holds `lengths[i]` tokens at positions `starts[i]...`."""

    tokens: Tensor     # [1, N]: every row's tokens, one row after another
    positions: Tensor  # [1, N]: each token's absolute position
    rows: list[int]    # the cache row of each of the forward's rows
    starts: list[int]
    lengths: list[int]
    offsets: list[int]  # where each row's tokens begin in the packed sequence
    row_of: Tensor     # [N]: index i of each token's row
    col_of: Tensor     # [N]: index of each token within its row
    cache_row_of: Tensor  # [N]: each token's cache row
    bucketed: bool = False  # N, the attention width and the keys read come from a few buckets

    @staticmethod
    def pack(rows: Sequence[int], starts: Sequence[int], tokens: Sequence[Sequence[int]],
             device: torch.device | str, *, padding_row: int | None = None, capacity: int = 0) -> "Ragged":
        """With `padding_row` (a scratch cache row no real row uses), the packed tokens are
        padded up to `token_bucket(N)` by rows of filler tokens in that cache row, at positions
        from 0, after the real rows: callers read the real rows by `offsets` and ignore the
        rest. A filler row is no wider than the widest real row (attention's width stays) nor
        than `capacity`; filler rows overlap in the cache, and their K/V are never read."""
        if padding_row is not None:
            real = sum(len(t) for t in tokens)
            pad, chunk = token_bucket(real) - real, min(capacity, max(map(len, tokens)))
            fill = [min(chunk, pad - lo) for lo in range(0, pad, chunk)]
            rows, starts = [*rows, *[padding_row] * len(fill)], [*starts, *[0] * len(fill)]
            tokens = [*tokens, *[[0] * n for n in fill]]
        lengths = [len(t) for t in tokens]
        if not lengths or min(lengths) < 1 or not len(rows) == len(starts) == len(lengths):
            raise ValueError("a ragged forward needs one start and at least one token per row")
        offsets = [0, *accumulate(lengths[:-1])]
        row_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        col_of = torch.arange(row_of.shape[0]) - torch.tensor(offsets)[row_of]
        positions = torch.tensor(list(starts))[row_of] + col_of
        flat = [t for row in tokens for t in row]
        return Ragged(torch.tensor([flat], device=device), positions[None].to(device), list(rows), list(starts),
                      lengths, offsets, row_of.to(device), col_of.to(device),
                      torch.tensor(list(rows))[row_of].to(device), padding_row is not None)

    @property
    def width(self) -> int:
        """Tokens per row of attention's padded layout."""
        return token_bucket(max(self.lengths)) if self.bucketed else max(self.lengths)

    def padded_positions(self) -> Tensor:
        """[rows, width] positions; a padding entry repeats its row's first position, so its
        query has keys to attend to (its output is dropped)."""
        pad = torch.tensor(self.starts, device=self.positions.device)[:, None].repeat(1, self.width)
        pad[self.row_of, self.col_of] = self.positions[0]
        return pad

    def to_padded(self, x: Tensor) -> Tensor:
        """Packed [N, ...] -> padded [rows, width, ...] (zeros in the padding)."""
        out = x.new_zeros(len(self.lengths), self.width, *x.shape[1:])
        out[self.row_of, self.col_of] = x
        return out

    def to_packed(self, x: Tensor) -> Tensor:
        """Padded [rows, width, ...] -> packed [N, ...]."""
        return x[self.row_of, self.col_of]
