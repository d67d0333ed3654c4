"""Devices and dtypes a request names, checked before any tensor moves, so that a machine
that cannot run them gets one clear error instead of a torch traceback."""

from __future__ import annotations

import torch

from failfast.errors import GenerationInputError


def check_device(device: str | torch.device, dtype: torch.dtype | None = None) -> torch.device:
    """The parsed device, if this machine has it (and can compute in `dtype` there)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise GenerationInputError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:1, mps)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise GenerationInputError(f"device {device!r} asked for, but this machine has no usable CUDA GPU "
                                       f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise GenerationInputError(f"device {device!r} asked for, but this machine has {count} CUDA GPU(s)")
        if dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise GenerationInputError("this GPU cannot compute in bfloat16; pass --dtype float16 or float32")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise GenerationInputError(f"device {device!r} asked for, but MPS is not available on this machine")
        if dtype is torch.float64:
            raise GenerationInputError("MPS has no float64; pass --dtype float32")
    elif dev.type != "cpu":
        raise GenerationInputError(f"device type {dev.type!r} is not supported (cpu, cuda or mps)")
    return dev
