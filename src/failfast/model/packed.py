"""Prepacked weights for CPU inference (docs/design.md, "Prepacked weights").

On the CPU, `F.linear` in bfloat16 hands every call to oneDNN, which first reorders the
weight into its blocked layout. At our models' row counts (1 to 33 rows) that reorder costs
about as much as the product: a 1 x 384 x 1024 product takes 45 us, 21 us with the weight
reordered once at load time (`torch.ops.mkldnn._reorder_linear_weight`, what PyTorch's
compiler does when it freezes weights) and multiplied by `torch.ops.mkldnn._linear_pointwise`.
The packed product is the same oneDNN kernel: where bf16 is native its rows do not depend on
how many rows share a call (tests/test_packed.py), so 16-bit verification still rounds like
one-token decoding (where oneDNN emulates bf16, no bf16 product is row-invariant).
oneDNN's packed float32 product is not row-invariant, so float32 weights get another layout,
in place: column-major (the transpose, contiguous). `F.linear` of a row-major weight hands
MKL a transposed operand, and on an AVX-512 Xeon without bf16 that product is 3-10x slower from 4
rows on (the target's head at 8 rows: 772 us, 396 us column-major; q/k/v: 279 vs 37 us).
With MKL a float32 row depends on the row count either way (its one-row path differs). Where
the tiled float32 kernel runs (AVX-512; model/tiled.py), float32 layers also get tiles for it:
faster at decoding's row counts, and a row rounds the same whatever the row count; the
column-major weight serves products over more rows (prefill).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from failfast.model.tiled import TiledWeight, tile
from failfast.model.transformer import Linear, Product, fuse_projections, side_by_side


def packs_for_onednn(weight: Tensor) -> bool:
    """True for a bfloat16 CPU weight on a PyTorch whose oneDNN runs bf16 natively."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not weight.requires_grad
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packs_column_major(weight: Tensor) -> bool:
    """True for a float32 CPU weight that takes no gradients."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and not weight.requires_grad


def can_pack(weight: Tensor) -> bool:
    return packs_for_onednn(weight) or packs_column_major(weight)


def pack_weight(weight: Tensor) -> Tensor | TiledWeight:
    """The weight [out, in] in oneDNN's blocked layout (bfloat16: an opaque `torch._mkldnn`
    tensor that `transformer.linear` multiplies with), or for float32 column-major (the same
    values and shape, transposed strides) and tiled for the float32 kernel where it runs
    (model/tiled.py); the weight itself if it cannot be packed."""
    if packs_for_onednn(weight):
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
    if packs_column_major(weight):
        laid_out = column_major(weight)
        return tile(laid_out) or laid_out
    return weight


def column_major(weight: Tensor) -> Tensor:
    """The same values and shape with transposed strides (the transpose, contiguous)."""
    return weight.detach().t().contiguous().t()


def pack_linears(model: nn.Module) -> int:
    """Pack every `Linear` of an inference model (bfloat16 or float32, CPU, no gradients);
    returns how many layers were packed. bfloat16: a packed copy beside each weight, which
    its forward then uses. float32: the weight itself is laid out column-major (same values
    and shape, so state dicts are unchanged), except a head tied to an embedding, which gets
    a column-major copy (an embedding lookup gathers rows, 7-20x slower from a column-major
    table); where the tiled kernel runs, each also gets its tiles (float16 values: half the
    weight's bytes). Attention's q/k/v and the MLP's gate/up projections
    also get one packed weight each, so that they run as one product (the same columns, fewer
    calls); in float32 the separate layers' weights become views of it. Pack after any `.to()`
    and after int8 quantization (whose layers it leaves alone)."""
    packed = 0
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, Linear) and can_pack(module.weight):
            if packs_column_major(module.weight) and id(module.weight) not in tables:
                module.weight.data = column_major(module.weight)
                module.pack(tile(module.weight))
            else:
                module.pack(pack_weight(module.weight))
            packed += 1
    fuse_projections(model, _packed_product)
    return packed


def _packed_product(layers: Sequence[nn.Module]) -> Callable[[Tensor], Tensor] | None:
    """One packed product of float layers side by side; None unless all of them can be
    packed. In float32 the layers' weights are re-pointed at row ranges of the fused one."""
    if not all(isinstance(layer, Linear) and can_pack(layer.weight) for layer in layers):
        return None
    weight, bias = side_by_side(layers)
    fused = pack_weight(weight)
    if packs_column_major(weight):
        laid_out = fused.weight if isinstance(fused, TiledWeight) else fused
        for layer, rows in zip(layers, laid_out.split([layer.weight.shape[0] for layer in layers])):
            layer.weight.data = rows
            layer.pack(None)  # the fused product serves the layer (its own tiles would be a second copy)
    return Product(fused, bias)
