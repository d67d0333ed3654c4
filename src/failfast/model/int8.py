"""Int8 weights for a drafter's linear layers (docs/design.md, "Int8 drafters").

A drafter only proposes tokens: verification decides, so its arithmetic may be coarse
without changing the output. On CPUs a drafter pass is a few small matmuls, and PyTorch's
weight-only int8 matmul (`torch._weight_int8pack_mm`: int8 weights with one scale per
output channel, activations in bf16, fp16 or float32) runs them faster than bf16 weights
do. The target is never quantized.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from failfast.errors import IncompatibleModelsError
from failfast.model.checkpoint import LoadedModel, load_model, read_config
from failfast.model.config import ModelConfig
from failfast.model.packed import pack_linears
from failfast.model.transformer import Linear, fuse_projections, side_by_side

# Linear layers that stay as they are: a Transformer drafter's output head (tied to its
# embedding), and the feature fusion `fc` of DFlash / EAGLE-3 drafters (their dtype and
# device are read from it, and it runs once per round, not per pass).
KEEP = ("lm_head", "fc")
ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8 weights [out, in] and their scales (in the weight's dtype)."""
    weight = weight.detach()
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    # contiguous: the int8 kernel needs it, and a packed float32 weight is column-major
    return (weight.float() / scale[:, None]).round().to(torch.int8).contiguous(), scale.to(weight.dtype)


def int8_linear(x: Tensor, weight_int8: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ (weight_int8 * scale).T + bias over the last dimension of x, in x's dtype."""
    out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), weight_int8, scale)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight_int8.shape[0])


class Int8Linear(nn.Module):
    """A `Linear` with symmetric per-output-channel int8 weights; activations keep their dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight_int8, scale = quantize(linear.weight)
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: Tensor) -> Tensor:
        return int8_linear(x, self.weight_int8, self.scale, self.bias)


def _int8_product(layers: Sequence[nn.Module]) -> Callable[[Tensor], Tensor]:
    """One int8 product of float layers side by side (per-channel scales: the same numbers as
    quantizing each layer alone)."""
    weight, bias = side_by_side(layers)
    weight_int8, scale = quantize(weight)
    return partial(int8_linear, weight_int8=weight_int8, scale=scale, bias=bias)


def int8_pays(config: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> bool:
    """Whether a drafter gets int8 weights by default: on a CPU, in bfloat16, for the kind
    where int8 drafting measured faster than packed bf16 weights (README, "Int8 drafters"): an
    AR drafter (one-row chain passes, +9% to +14% tokens/s). Block diffusion (-3%), DFlash
    (-8%) and EAGLE-3 (-4%) drafted no faster end to end."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and not config.reads_target
            and not config.is_block_diffusion)


def load_drafter(path: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu",
                 int8: bool | None = None) -> LoadedModel:
    """A drafter model computing in `dtype`, with int8 linear layers if `int8`, or where they
    pay (`int8_pays`) when it is None. Int8 layers compute in `dtype` where the int8 matmul
    takes it, else float32 (a float64 drafter beside a float64 target)."""
    if int8 is None:
        int8 = int8_pays(read_config(Path(path)), dtype, device)
    if not int8:
        return load_model(path, dtype=dtype, device=device)
    loaded = load_model(path, dtype=dtype if dtype in ACTIVATION_DTYPES else torch.float32, device=device, pack=False)
    quantize_drafter(loaded.model)
    pack_linears(loaded.model)  # what stays in bf16 (head, feature fusion)
    return loaded


def quantize_drafter(model: nn.Module) -> int:
    """Swap every linear layer of a drafter model (any kind; CPU; 16- or 32-bit float) for
    `Int8Linear`, except `KEEP`; the target's borrowed embedding and head are not the
    drafter's modules, so they are never touched. Returns how many were swapped."""
    first = next(model.parameters())
    if first.dtype not in ACTIVATION_DTYPES or first.device.type != "cpu":
        raise IncompatibleModelsError(f"int8 drafter weights need a float32, bfloat16 or float16 drafter on the CPU, "
                                      f"got {first.dtype} on {first.device}")
    fuse_projections(model, _int8_product)  # from the float weights, before they are swapped
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and name not in KEEP:
                setattr(parent, name, Int8Linear(child))
                swapped += 1
    return swapped
