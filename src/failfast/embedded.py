"""The models shipped inside the package, addressable by short name."""

from __future__ import annotations

from pathlib import Path

from failfast.errors import CheckpointError

MODELS_DIR = Path(__file__).parent / "models"
EMBEDDED = ("target", "ar-drafter", "dllm-drafter", "dflash-drafter", "eagle3-drafter")
DEFAULT_TARGET = "target"
DEFAULT_DRAFTER = "dllm-drafter"
CORPUS_MANIFEST = MODELS_DIR / "corpus.json"  # which stdlib files the models never saw


def resolve_model(name_or_path: str | Path) -> Path:
    """An existing folder as given, else an embedded model by short name."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    if str(name_or_path) in EMBEDDED:
        folder = MODELS_DIR / str(name_or_path)
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"embedded model {name_or_path!r} is missing from {MODELS_DIR}")
        return folder
    raise CheckpointError(f"model folder {path} does not exist (embedded models: {', '.join(EMBEDDED)})")
