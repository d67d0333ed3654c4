"""Which floating-point type to run in: bfloat16 where the hardware multiplies it natively,
float32 elsewhere (docs/design.md, "Precision").

On a CPU without native bf16 matrix instructions, PyTorch emulates bf16 matmuls: measured on
an AVX2-only 2-core VM, a 32-token target forward took 106 ms in bf16 against 38 ms in
float32, and bf16 training ran 25x slower. With AVX512-BF16 or AMX, bf16 is 1.3-1.9x faster.
"""

from __future__ import annotations

import torch

from failfast.errors import GenerationInputError

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
    """bfloat16 where it is native and fast, float32 everywhere else."""
    return torch.bfloat16 if has_native_bf16(device) else torch.float32


def resolve_dtype(name: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; None or "auto" picks `default_dtype(device)`."""
    if name is None or name == "auto":
        return default_dtype(device)
    if name not in DTYPES:
        raise GenerationInputError(f"unknown dtype {name!r}; choose from auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]
