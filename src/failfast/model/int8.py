"""Int8 weights for a drafter's linear layers (docs/design.md, "Int8 drafters").

A drafter only proposes tokens: verification decides, so its arithmetic may be coarse
without changing the output. On CPUs, PyTorch's dynamic int8 linear (fbgemm: int8 weights
per output channel, activations quantized per call) runs a drafter pass's small matmuls
faster than bf16 ones. The target is never quantized.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from failfast.errors import IncompatibleModelsError
from failfast.model.transformer import Linear, Transformer


class Int8Linear(nn.Module):
    """A `Linear` with symmetric per-output-channel int8 weights; float32 in and out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float().cpu()
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        zero = torch.zeros(weight.shape[0], dtype=torch.long)
        quantized = torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8)
        bias = None if linear.bias is None else linear.bias.detach().float().cpu()
        self.out_features = weight.shape[0]
        self._packed = torch.ops.quantized.linear_prepack(quantized, bias)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        out = torch.ops.quantized.linear_dynamic(rows, self._packed, True)  # reduce_range: fbgemm's int16 sums
        return out.view(*x.shape[:-1], self.out_features)


def quantize_drafter(model: Transformer) -> int:
    """Swap the decoder layers' linear layers of a token-only drafter (block-diffusion or AR;
    float32 on CPU) for `Int8Linear`; the embedding and output head stay float32. Returns how
    many were swapped."""
    if not isinstance(model, Transformer):
        raise IncompatibleModelsError("int8 weights are for drafters that read only tokens (block-diffusion or AR), "
                                      "not for drafters that read the target's features")
    if model.dtype != torch.float32 or model.device.type != "cpu":
        raise IncompatibleModelsError(f"int8 drafter weights need a float32 drafter on the CPU, got {model.dtype} "
                                      f"on {model.device}")
    swapped = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, Linear):
                    setattr(parent, name, Int8Linear(child))
                    swapped += 1
    return swapped
