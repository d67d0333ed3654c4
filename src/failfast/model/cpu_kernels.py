"""Float32 CPU kernels for inference on AVX-512 CPUs (docs/design.md, "Float32 CPU kernels"):
`cpu_kernels.cpp`, built on first use by PyTorch's extension loader (about 30 s) and cached
per machine, source and PyTorch version.

Each kernel computes a row's result in one fixed order whatever else shares the call, so a
k-token verification rounds like k one-token forwards. Used for float32 inference only
(float64, 16-bit and training keep PyTorch's ops). Set FAILFAST_CPU_KERNELS=0 to turn them off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import sysconfig
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
SWITCH = "FAILFAST_CPU_KERNELS"
# no contraction of a multiply and an add into one FMA unless the source asks for it
COMPILE_FLAGS = ["-O3", "-mavx512f", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
NAME = "failfast_cpu_kernels"


def toolchain() -> bool:
    """True when a C++ compiler and ninja (the system's, or the `ninja` package's) are there to
    build the kernels; puts the package's ninja on PATH when the system has none."""
    if shutil.which("ninja") is None:
        try:
            import ninja  # the pip package: a dependency of failfast
            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except (ImportError, AttributeError):
            return False
    compiler = os.environ.get("CXX", "c++").split()  # may be a launcher and a compiler ("ccache g++")
    return bool(compiler) and shutil.which(compiler[0]) is not None


def cache_dir() -> Path:
    """Where the built kernels are kept: one folder per source, flags and PyTorch version."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "failfast" / "kernels"
    tag = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + " ".join(COMPILE_FLAGS).encode()
                         + (sysconfig.get_config_var("EXT_SUFFIX") or "").encode())  # the Python ABI too
    return root / f"{NAME}-{tag.hexdigest()[:16]}"


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled kernels, or None where they cannot run: FAILFAST_CPU_KERNELS=0, a CPU that
    PyTorch does not run at AVX-512 (`ATEN_CPU_CAPABILITY` may lower it), no C++ compiler or
    a failed build (a warning says why)."""
    if os.environ.get(SWITCH, "1") == "0" or torch.backends.cpu.get_cpu_capability() != "AVX512":
        return None
    if not toolchain():
        warnings.warn(f"failfast: no C++ compiler (or ninja) to build the float32 CPU kernels; PyTorch's ops run "
                      f"instead (install g++, or set {SWITCH}=0 to silence this)", stacklevel=2)
        return None
    try:
        from torch.utils.cpp_extension import load
        build = cache_dir()
        if not (build / f"{NAME}.so").exists():
            print("failfast: compiling float32 CPU kernels for this machine (once, about 30 s)", file=sys.stderr)
        build.mkdir(parents=True, exist_ok=True)
        return load(NAME, [str(SOURCE)], extra_cflags=COMPILE_FLAGS, extra_ldflags=["-fopenmp"],
                    build_directory=str(build))
    except Exception as err:  # noqa: BLE001 - any build failure falls back to PyTorch's ops
        warnings.warn(f"failfast: the float32 CPU kernels did not build ({err}); {SWITCH}=0 silences this",
                      stacklevel=2)
        return None


def runs_on(x: torch.Tensor, *weights: torch.Tensor) -> ModuleType | None:
    """The kernels if they serve this float32 CPU inference call (no tensor takes gradients), else None."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or any(w.requires_grad for w in weights):
        return None
    return kernels()
