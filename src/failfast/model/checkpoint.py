"""Load and save Hugging Face-format checkpoint folders (safetensors only, never pickles)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from failfast.errors import CheckpointError
from failfast.model.config import ModelConfig
from failfast.model.device import check_device
from failfast.model.dflash import DFlashModel
from failfast.model.eagle3 import Eagle3Model
from failfast.model.packed import pack_linears
from failfast.model.tokenizer import Tokenizer
from failfast.model.transformer import Rotary, Transformer

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
PICKLE_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")


@dataclass
class LoadedModel:
    model: Transformer | DFlashModel | Eagle3Model  # the drafter kinds that read target features have their own
    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path


@dataclass(frozen=True)
class ModelDescription:
    """A checkpoint's config and tokenizer without its weights: enough to check a drafter
    against a target that another engine runs (integrations/vllm.py)."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    path: Path


def describe_model(path: str | Path) -> ModelDescription:
    """Read config.json (and generation_config.json's EOS ids) and tokenizer.json, if any."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    return ModelDescription(read_config(folder), _read_tokenizer(folder), folder)


def _read_tokenizer(folder: Path) -> Tokenizer | None:
    tok_path = folder / "tokenizer.json"
    return Tokenizer.from_file(tok_path) if tok_path.is_file() else None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


def read_config(folder: Path) -> ModelConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    raw = _read_json(cfg_path)
    gen_path = folder / "generation_config.json"
    if gen_path.is_file() and "eos_token_id" in (gen := _read_json(gen_path)):
        raw = {**raw, "eos_token_id": gen["eos_token_id"]}
    return ModelConfig.from_dict(raw)


def _weight_files(folder: Path) -> list[Path]:
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    if (folder / SHARD_INDEX).is_file():
        index = _read_json(folder / SHARD_INDEX)
        shards = sorted(set(index.get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{folder / SHARD_INDEX} lists no weight files")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{folder} lacks shard files: {', '.join(missing)}")
        return [folder / s for s in shards]
    if any((folder / name).exists() for name in PICKLE_NAMES):
        raise CheckpointError(f"{folder} holds pickle weights; failfast loads only safetensors "
                              "(convert them with safetensors first)")
    raise CheckpointError(f"{folder} has no {SINGLE_FILE} or {SHARD_INDEX}")


def _read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {f} (truncated or corrupt?): {exc}") from None
    return state


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", pack: bool = True) -> LoadedModel:
    """Load config.json, safetensors weights and (if present) tokenizer.json from a folder;
    `pack`: bfloat16 and float32 weights prepacked for the CPU (`model/packed.py`), the default;
    a model whose weights will train is loaded with `pack=False`."""
    device = check_device(device, dtype)
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist")
    cfg = read_config(folder)
    state = _read_weights(_weight_files(folder))
    tied = cfg.tie_word_embeddings and not cfg.reads_target
    if tied:
        state.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = DFlashModel(cfg) if cfg.is_dflash else Eagle3Model(cfg) if cfg.is_eagle3 else Transformer(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{folder}: weights do not match config.json "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise CheckpointError(f"{folder}: {name} has shape {tuple(state[name].shape)}, "
                                  f"config.json implies {tuple(shape)}")
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    del state  # packing below makes new layouts: the read tensors must not outlive it
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta).to(device)
    model.eval().requires_grad_(False)
    if pack:
        pack_linears(model)  # on a CPU: bf16 weights reordered for oneDNN, float32 column-major (model/packed.py)
    return LoadedModel(model, cfg, _read_tokenizer(folder), folder)


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Split tensors, in order, into groups of at most `max_bytes` (a larger tensor gets its own)."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    return groups


def save_model(model: Transformer | DFlashModel | Eagle3Model, path: str | Path, *, dtype: torch.dtype | None = None,
               tokenizer: Tokenizer | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer.json) in Hugging Face layout; with
    `max_shard_bytes`, weights larger than that go to numbered shards plus an index."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg_dict = model.config.to_dict()
    if dtype is not None:
        cfg_dict["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # a DFlash or EAGLE-3 drafter has none: it uses the target's
    for stale in [folder / SINGLE_FILE, folder / SHARD_INDEX, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    groups = _shards(state, max_shard_bytes) if max_shard_bytes else [state]
    if len(groups) == 1:
        save_file(state, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, group in enumerate(groups, 1):
            name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            save_file(group, str(folder / name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, name))
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": weight_map}
        (folder / SHARD_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.inner.save(str(folder / "tokenizer.json"))
    return folder
