"""Float32 products for a few rows at a time on AVX-512 CPUs (docs/design.md, "Float32 CPU
kernels").

Decoding and verification multiply 1 to ~60 rows by each weight, so a float32 forward streams
its weights from memory and computes little. MKL's product streams them at about the
memory's speed for one row but from two rows on runs 1.4-1.9x slower than for one, and it
reads the weights as float32 although our checkpoints hold float16 values. The kernel in
`cpu_kernels.cpp` (model/cpu_kernels.py) reads float16 tiles, widened exactly in registers, in the order it uses them: on the embedded
target's weights, one row 3.1 -> 1.7 ms, five rows 4.3-5.8 -> 2.3 ms, eight 4.8-5.7 -> 2.7 ms.
Each output sums its products in one fixed order, so a row rounds the same whatever else
shares the call: a k-token verification's linear layers compute what k one-token forwards do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from failfast.model.cpu_kernels import kernels

TILE = 64  # output columns per tile (the kernel's kTile)
# At most this many rows go to the kernel, more to MKL's product (a long prompt's prefill). On
# the embedded target's products the kernel is as fast as MKL up to ~96 rows and 11% slower at
# 256 (26% at 512); up to 256 rows, verifications of whole batches are row-invariant too.
MAX_ROWS = 256


@dataclass(frozen=True, eq=False)
class TiledWeight:
    """A float32 weight [out, in] for `transformer.linear`: the kernel's tiles for up to
    MAX_ROWS rows, the weight itself (column-major, model/packed.py) for more."""

    tiles: Tensor   # [ceil(out / 64), in, 64]: float16 if every weight is a float16 value, else float32
    weight: Tensor  # float32 [out, in]

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def takes(self, x: Tensor, bias: Tensor | None) -> bool:
        """True for float32 input of at most MAX_ROWS rows that takes no gradients (the kernel
        has no backward)."""
        grads = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        return x.dtype == torch.float32 and x.numel() <= MAX_ROWS * x.shape[-1] and not grads

    def product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x [..., in] times the weight, plus bias: [..., out] (for input it `takes`)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = kernels().tiled_linear(rows, self.tiles, self.weight.shape[0],  # type: ignore[union-attr]
                                    None if bias is None else bias.contiguous())
        return out.view(*x.shape[:-1], self.weight.shape[0])


def tile(weight: Tensor) -> TiledWeight | None:
    """`weight` (float32 on the CPU, no gradients) as a TiledWeight, or None where the kernel
    does not run. The tiles are a copy: change the weight and tile it again."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.requires_grad or kernels() is None:
        return None
    out, inner = weight.shape
    count = -(-out // TILE)
    padded = torch.zeros(count * TILE, inner, dtype=torch.float32)
    padded[:out] = weight.detach()
    tiles = padded.view(count, TILE, inner).transpose(1, 2).contiguous()
    half = tiles.half()
    exact = bool(torch.equal(half.float(), tiles))  # float16 values (our checkpoints): half the bytes
    return TiledWeight(half if exact else tiles, weight.detach())
