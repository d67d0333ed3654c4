"""Which floating-point type to run in (docs/design.md, "Precision").

Inference: bfloat16 on CUDA, float32 on CPUs. On a CPU, 16-bit verification does not always
round like one-token decoding even with `batch_invariant_attention` (PyTorch's bf16 matmuls
change kernel with the row count past ~33 rows and, in attention, at long contexts), so a
near-tie can flip a token; float32 keeps such flips about a million times rarer, and plain
decoding of small models is fastest in float32 anyway (3.3 vs 5.5 ms per token for the
embedded target on an AVX512-BF16/AMX CPU). Training: bf16 autocast where bf16 is native
(AVX512-BF16, AMX, CUDA), which is 10x faster there; on an AVX2-only CPU bf16 is emulated
and 25x slower, so float32.
"""

from __future__ import annotations

import torch

from failfast.errors import GenerationInputError
from failfast.model.device import check_device

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64,
                                  "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when this CPU has AVX512-BF16 or AMX tiles (x86), as PyTorch's own kernels check."""
    cpu = torch.cpu
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def has_native_bf16(device: str | torch.device) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """Inference dtype: bfloat16 on a CUDA device that supports it, float32 everywhere else."""
    dev = check_device(device)
    return torch.bfloat16 if dev.type == "cuda" and has_native_bf16(dev) else torch.float32


def resolve_dtype(name: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; None or "auto" picks `default_dtype(device)`."""
    if name is None or name == "auto":
        return default_dtype(device)
    if name not in DTYPES:
        raise GenerationInputError(f"unknown dtype {name!r}; choose from auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]
