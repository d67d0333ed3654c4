"""The training corpus: the running interpreter's standard-library Python source, plus, if
asked, the Python source of installed packages (more varied code than the stdlib alone).

Files are listed in a fixed order; a file is held out when a hash of its corpus name (its
path relative to the stdlib, or `<package>/<path in the package>`) falls in the held-out
share, so the split is stable across machines and runs, and adding packages leaves the
stdlib's split (the benchmark's held-out functions) as it was.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from failfast.errors import FailfastError

HELD_OUT_PERCENT = 5
EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3"}


class CorpusError(FailfastError):
    """The corpus is missing or empty."""


@dataclass(frozen=True)
class Package:
    """An installed package whose `.py` files join the corpus."""

    name: str
    version: str | None  # its distribution's version, if installed as one
    root: Path


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: list[Path]
    held_out: list[Path]
    packages: tuple[Package, ...] = field(default=())

    def name(self, path: Path) -> str:
        return corpus_name(path, self.root, self.packages)


def corpus_name(path: Path, root: Path, packages: Sequence[Package]) -> str:
    """A file's corpus name: its path under the stdlib root, or `<package>/<path>`."""
    for package in packages:
        if path.is_relative_to(package.root):
            return f"{package.name}/{path.relative_to(package.root).as_posix()}"
    return path.relative_to(root).as_posix()


def is_held_out(relative: str) -> bool:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def find_package(name: str, where: Path | None = None) -> Package:
    """A package by import name: its folder and its distribution's version, from `where` (a
    `pip install --target` folder, so the recipe pins what it reads) or from this Python."""
    if where is not None:
        root = Path(where) / name
        dists = list(importlib.metadata.distributions(name=name, path=[str(where)]))
        version = dists[0].version if dists else None
    else:
        spec = importlib.util.find_spec(name)
        root = Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
    if root is None or not root.is_dir():
        raise CorpusError(f"package {name!r} is not installed {f'in {where}' if where else 'here'} "
                          "(a corpus package must be a folder of modules)")
    return Package(name, version, root)


def _python_files(root: Path) -> list[Path]:
    files = sorted(p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts))
    return [p for p in files if p.stat().st_size > 0]


def split_corpus(root: Path | None = None, packages: Sequence[str] = (), packages_from: Path | None = None) -> CorpusSplit:
    """All `.py` files under root (default: the stdlib) and under each named package (found in
    `packages_from`, else installed here), split into train and held-out."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise CorpusError(f"corpus folder {root} does not exist")
    found = tuple(find_package(name, packages_from) for name in packages)
    files = _python_files(root) + [p for package in found for p in _python_files(package.root)]
    if not files:
        raise CorpusError(f"corpus folder {root} holds no non-empty .py files")
    held_out = {p: is_held_out(corpus_name(p, root, found)) for p in files}
    train = [p for p in files if not held_out[p]]
    held = [p for p in files if held_out[p]]
    if not train:
        raise CorpusError(f"corpus folder {root} has no training files after the held-out split")
    return CorpusSplit(root, train, held, found)


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
