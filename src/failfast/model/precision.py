"""Which floating-point type to run in (docs/design.md, "Precision").

Inference: bfloat16 on CUDA and on CPUs with AVX512-BF16 but no AMX tiles, float32 on other
CPUs. bfloat16 is where it is fastest by measurement: on an AVX512-BF16 CPU the embedded
target's one-token forward takes 4.9 ms in bf16 against 5.8 in float32 and a 33-token
verification 8.5 against 19.1 (FailFast 1.30x faster); on the AMX CPU we measured, one-token
decoding was slower in bf16 (5.5 vs 3.3 ms), and without native bf16 it is emulated. 16-bit
verification rounds like one-token decoding only because every 16-bit matmul is row- and
key-blocked (`model/transformer.py`). Training: bf16 autocast where bf16 is native
(AVX512-BF16, AMX, CUDA); on an AVX2-only CPU bf16 is emulated and 25x slower, so float32."""

from __future__ import annotations

import torch

from failfast.errors import GenerationInputError
from failfast.model.device import check_device

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64,
                                  "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cpu_has(check: str) -> bool:
    """PyTorch's own CPU feature check `torch.cpu._is_<check>_supported` (False if absent)."""
    return getattr(torch.cpu, f"_is_{check}_supported", lambda: False)()


def cpu_has_native_bf16() -> bool:
    """True when this CPU has AVX512-BF16 or AMX tiles (x86), as PyTorch's own kernels check."""
    return _cpu_has("avx512_bf16") or _cpu_has("amx_tile")


def cpu_prefers_bf16() -> bool:
    """True on a CPU where bf16 inference measured fastest: AVX512-BF16 without AMX tiles."""
    return _cpu_has("avx512_bf16") and not _cpu_has("amx_tile")


def has_native_bf16(device: str | torch.device) -> bool:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """Inference dtype: bfloat16 on a CUDA device that supports it and on CPUs where it
    measured fastest (`cpu_prefers_bf16`), float32 everywhere else."""
    dev = check_device(device)
    fast_bf16 = has_native_bf16(dev) if dev.type == "cuda" else dev.type == "cpu" and cpu_prefers_bf16()
    return torch.bfloat16 if fast_bf16 else torch.float32


def resolve_dtype(name: str | None, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype by name; None or "auto" picks `default_dtype(device)`."""
    if name is None or name == "auto":
        return default_dtype(device)
    if name not in DTYPES:
        raise GenerationInputError(f"unknown dtype {name!r}; choose from auto, {', '.join(sorted(DTYPES))}")
    return DTYPES[name]
