"""Float32 products for a few rows at a time on AVX-512 CPUs (docs/design.md, "Tiled float32
products").

Decoding and verification multiply 1 to ~60 rows by each weight, so a float32 forward streams
its weights from memory and computes little. MKL's product streams them at about the
memory's speed for one row but from two rows on runs 1.4-1.9x slower than for one, and it
reads the weights as float32 although our checkpoints hold float16 values. The kernel in
`tiled_linear.cpp` (built on first use with PyTorch's extension loader and cached per machine)
reads float16 tiles, widened exactly in registers, in the order it uses them: on the embedded
target's weights, one row 3.1 -> 1.7 ms, five rows 4.3-5.8 -> 2.3 ms, eight 4.8-5.7 -> 2.7 ms.
Each output sums its products in one fixed order, so a row rounds the same whatever else
shares the call: a k-token verification's linear layers compute what k one-token forwards do.

Set FAILFAST_TILED_LINEAR=0 to use PyTorch's products instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("tiled_linear.cpp")
SWITCH = "FAILFAST_TILED_LINEAR"
TILE = 64  # output columns per tile (the kernel's kTile)
# At most this many rows go to the kernel, more to PyTorch's product (a prompt's prefill): the
# kernel measured at least as fast as MKL up to 64 rows on the embedded target, 10% slower at 128.
MAX_ROWS = 64
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mfma", "-mf16c", "-fopenmp"]


def cache_dir() -> Path:
    """Where built kernels are kept: one folder per source and PyTorch version."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "failfast" / "kernels"
    tag = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(COMPILE_FLAGS).encode())
    return root / f"tiled_linear-{tag.hexdigest()[:16]}"


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernel, or None where it cannot run: FAILFAST_TILED_LINEAR=0, a CPU that
    PyTorch does not run at AVX-512 (`ATEN_CPU_CAPABILITY` may lower it), or a failed build
    (a warning says why)."""
    if os.environ.get(SWITCH, "1") == "0" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    name = "failfast_tiled_linear"
    build = cache_dir()
    if not (build / f"{name}.so").exists():
        print("failfast: compiling the float32 CPU kernel for this machine (once, about 30 s)", file=sys.stderr)
    try:
        from torch.utils.cpp_extension import load
        build.mkdir(parents=True, exist_ok=True)
        return load(name, [str(SOURCE)], extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"],
                    build_directory=str(build))
    except Exception as err:  # noqa: BLE001 - any build failure falls back to PyTorch's products
        warnings.warn(f"failfast: the float32 CPU kernel did not build ({err}); {SWITCH}=0 silences this",
                      stacklevel=2)
        return None


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

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def takes(self, x: Tensor) -> bool:
        """True for float32 input of at most MAX_ROWS rows."""
        return x.dtype == torch.float32 and x.numel() <= MAX_ROWS * x.shape[-1]

    def product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        """x [..., in] times the weight, plus bias: [..., out] (for input that `takes`)."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = kernel().tiled_linear(rows, self.tiles, self.weight.shape[0],  # type: ignore[union-attr]
                                    None if bias is None else bias.contiguous())
        return out.view(*x.shape[:-1], self.weight.shape[0])


def tile(weight: Tensor) -> TiledWeight | None:
    """`weight` (float32 on the CPU, no gradients) as a TiledWeight, or None where the kernel
    does not run. The tiles are a copy: change the weight and tile it again."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.requires_grad or kernel() is None:
        return None
    out, inner = weight.shape
    count = -(-out // TILE)
    padded = torch.zeros(count * TILE, inner, dtype=torch.float32)
    padded[:out] = weight.detach()
    tiles = padded.view(count, TILE, inner).transpose(1, 2).contiguous()
    half = tiles.half()
    exact = bool(torch.equal(half.float(), tiles))  # float16 values (our checkpoints): half the bytes
    return TiledWeight(half if exact else tiles, weight.detach())
