"""Tokenised corpus on disk and seeded random training windows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import Tensor

from failfast.errors import FailfastError
from failfast.model import Tokenizer
from failfast.train.corpus import CorpusSplit, read_text, split_corpus
from failfast.train.tokenizer import load_tokenizer, special_ids, train_tokenizer

TOKENIZER_FILE = "tokenizer.json"
TRAIN_FILE = "train.npy"
HELD_OUT_FILE = "heldout.npy"
MANIFEST_FILE = "manifest.json"


def _encode_files(files: list[Path], tokenizer: Tokenizer, eos: int) -> np.ndarray:
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer.encode(read_text(f)))
        ids.append(eos)
    return np.asarray(ids, dtype=np.uint16 if tokenizer.vocab_size <= 65536 else np.int32)


def prepare_data(out: Path, corpus_root: Path | None = None, vocab_size: int = 8192,
                 packages: Sequence[str] = (), tokenizer_file: Path | None = None,
                 packages_from: Path | None = None) -> dict:
    """Tokenise both splits (the stdlib, or `corpus_root`, plus `packages`, from `packages_from`
    or installed here) and write a manifest naming held-out files and the packages' versions.
    The tokenizer is trained on the training split, or read from `tokenizer_file` (a model's
    own: a model that continues training on more code keeps its vocabulary)."""
    split: CorpusSplit = split_corpus(corpus_root, packages, packages_from)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file else train_tokenizer(split.train, vocab_size)
    tokenizer.inner.save(str(out / TOKENIZER_FILE))
    eos, _ = special_ids(tokenizer)
    train, held = _encode_files(split.train, tokenizer, eos), _encode_files(split.held_out, tokenizer, eos)
    np.save(out / TRAIN_FILE, train)
    np.save(out / HELD_OUT_FILE, held)
    manifest = {
        "corpus_root": str(split.root),
        "train_files": len(split.train),
        "train_tokens": int(train.size),
        "held_out_tokens": int(held.size),
        "vocab_size": tokenizer.vocab_size,
        "packages": [{"name": p.name, "version": p.version,
                      "files": sum(f.is_relative_to(p.root) for f in split.train + split.held_out)}
                     for p in split.packages],
        "held_out_files": [split.name(p) for p in split.held_out],
    }
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


@dataclass
class PreparedData:
    folder: Path
    tokenizer: Tokenizer
    train: Tensor
    held_out: Tensor
    manifest: dict

    @classmethod
    def load(cls, folder: Path) -> "PreparedData":
        folder = Path(folder)
        needed = [TOKENIZER_FILE, TRAIN_FILE, HELD_OUT_FILE, MANIFEST_FILE]
        missing = [n for n in needed if not (folder / n).is_file()]
        if missing:
            raise FailfastError(f"{folder} is not prepared data (missing {', '.join(missing)}); "
                                "run `failfast train data` first")
        load = lambda name: torch.from_numpy(np.load(folder / name).astype(np.int64))  # noqa: E731
        return cls(folder, load_tokenizer(folder / TOKENIZER_FILE), load(TRAIN_FILE), load(HELD_OUT_FILE),
                   json.loads((folder / MANIFEST_FILE).read_text()))


def windows(stream: Tensor, batch: int, length: int, generator: torch.Generator) -> Tensor:
    """`batch` random windows of `length` tokens from a 1-D token stream, or from random rows
    of a 2-D [N, L] tensor (self-distillation rows: a window never spans two rows)."""
    if stream.dim() == 2:
        if stream.shape[1] < length:
            raise FailfastError(f"rows have {stream.shape[1]} tokens, fewer than one window of {length}")
        rows = torch.randint(0, stream.shape[0], (batch,), generator=generator)
        offsets = torch.randint(0, stream.shape[1] - length + 1, (batch,), generator=generator)
        return torch.stack([stream[r, o:o + length] for r, o in zip(rows.tolist(), offsets.tolist())])
    if stream.numel() <= length:
        raise FailfastError(f"corpus has {stream.numel()} tokens, fewer than one window of {length}")
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=generator)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])
