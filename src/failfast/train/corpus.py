"""The training corpus: the running interpreter's standard-library Python source.

Files are listed in a fixed order; a file is held out when a hash of its relative path
falls in the held-out share, so the split is stable across machines and runs.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from failfast.errors import FailfastError

HELD_OUT_PERCENT = 5
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3"}


class CorpusError(FailfastError):
    """The corpus is missing or empty."""


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: list[Path]
    held_out: list[Path]


def is_held_out(relative: str) -> bool:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_corpus(root: Path | None = None) -> CorpusSplit:
    """All `.py` files under root (default: the stdlib), split into train and held-out."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"corpus folder {root} does not exist")
    files = sorted(p for p in root.rglob("*.py")
                   if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts))
    files = [p for p in files if p.stat().st_size > 0]
    if not files:
        raise CorpusError(f"corpus folder {root} holds no non-empty .py files")
    train = [p for p in files if not is_held_out(p.relative_to(root).as_posix())]
    held = [p for p in files if is_held_out(p.relative_to(root).as_posix())]
    if not train:
        raise CorpusError(f"corpus folder {root} has no training files after the held-out split")
    return CorpusSplit(root, train, held)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
