"""Self-distillation data: the target's own continuations of corpus prefixes.

A drafter is only worth what verification accepts, and verification checks the target's
own choices. Training drafters on what the target writes (greedy, plus a share sampled at a
temperature for variety) teaches them exactly that (docs/design.md, "Training").

Rows are `prompt_len` corpus tokens followed by `new_tokens` target tokens, generated in
batches of same-length prompts (one forward per new token for the whole batch). Output is
written in shards, each seeded by its index, so an interrupted run resumes at the first
missing shard and produces the same rows as an uninterrupted one. Asking for more tokens in
the same folder adds shards (a longer run's rows extend a shorter run's), so generation can
grow across sessions.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch import Tensor

from failfast.errors import FailfastError
from failfast.model import Transformer, load_model
from failfast.progress import log_milestone
from failfast.train.data import PreparedData

MANIFEST_FILE = "manifest.json"


@dataclass(frozen=True)
class SelfDistillSettings:
    tokens: int                 # target-written tokens to produce (rounded up to whole shards)
    prompt_len: int = 64
    new_tokens: int = 192
    batch_size: int = 64
    shard_batches: int = 4      # batches per shard file
    sampled_share: float = 0.25  # share of rows sampled at `temperature` instead of greedy
    temperature: float = 0.8
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.tokens, self.prompt_len, self.new_tokens, self.batch_size, self.shard_batches) < 1:
            raise FailfastError("self-distillation sizes (tokens, prompt and new lengths, batch, shard) must be >= 1")
        if not 0 <= self.sampled_share <= 1 or self.temperature <= 0:
            raise FailfastError(f"need 0 <= sampled share <= 1 and temperature > 0, got {self.sampled_share} "
                                f"and {self.temperature}")

    @property
    def shard_rows(self) -> int:
        return self.batch_size * self.shard_batches

    @property
    def shards(self) -> int:
        return -(-self.tokens // (self.shard_rows * self.new_tokens))


@torch.inference_mode()
def continue_batch(model: Transformer, prompts: Tensor, new_tokens: int, temperatures: Tensor,
                   generator: torch.Generator) -> Tensor:
    """Prompts [B, P] followed by `new_tokens` of the model's own tokens per row: greedy
    where the row's temperature is 0, sampled at that temperature elsewhere."""
    b, p = prompts.shape
    cache = model.new_cache(p + new_tokens, batch=b)
    rows = torch.empty(b, p + new_tokens, dtype=torch.long)
    rows[:, :p] = prompts
    sampled = temperatures > 0
    logits = model(prompts.to(model.device), 0, cache, logits_at=slice(-1, None))[:, -1].float().cpu()
    for i in range(new_tokens):
        token = logits.argmax(-1)
        if sampled.any():
            probs = torch.softmax(logits[sampled] / temperatures[sampled, None], dim=-1)
            token[sampled] = torch.multinomial(probs, 1, generator=generator)[:, 0]
        rows[:, p + i] = token
        if i + 1 < new_tokens:
            logits = model(token[:, None].to(model.device), p + i, cache)[:, -1].float().cpu()
    return rows


def _shard_path(out: Path, index: int) -> Path:
    return out / f"rows-{index:05d}.npy"


def _shard_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob("rows-*.npy") if not p.name.endswith(".tmp.npy"))


def _make_shard(model: Transformer, corpus: Tensor, s: SelfDistillSettings, index: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(s.seed * 1_000_003 + index)
    batches = []
    for _ in range(s.shard_batches):
        starts = torch.randint(0, corpus.numel() - s.prompt_len, (s.batch_size,), generator=gen)
        prompts = torch.stack([corpus[i:i + s.prompt_len] for i in starts.tolist()])
        temperatures = torch.where(torch.rand(s.batch_size, generator=gen) < s.sampled_share,
                                   torch.tensor(s.temperature), torch.tensor(0.0))
        batches.append(continue_batch(model, prompts, s.new_tokens, temperatures, gen))
    return torch.cat(batches).numpy().astype(np.uint16)


def _same_rows(a: dict, b: dict) -> bool:
    """Settings that make the same shard for the same index (the token count only sets how many)."""
    return {k: v for k, v in a.items() if k != "tokens"} == {k: v for k, v in b.items() if k != "tokens"}


def generate_self_distillation(target_dir: Path, data_dir: Path, out: Path, s: SelfDistillSettings,
                               dtype: torch.dtype = torch.float32) -> dict:
    """Write shards of rows [prompt | target continuation] to `out`; resumes where it stopped."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = PreparedData.load(data_dir)
    loaded = load_model(target_dir, dtype=dtype)
    if loaded.config.vocab_size != data.tokenizer.vocab_size or data.tokenizer.vocab_size > 65536:
        raise FailfastError(f"target {target_dir} (vocabulary {loaded.config.vocab_size}) does not match the "
                            f"corpus tokenizer ({data.tokenizer.vocab_size})")
    manifest_path = out / MANIFEST_FILE
    previous = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    if previous is not None and not _same_rows(previous["settings"], asdict(s)):
        raise FailfastError(f"{out} holds rows made with other settings; use a new folder")
    if previous is None:  # settings first, so that a resumed run can be checked against them
        previous = {"settings": asdict(s), "wall_s": 0.0}
        manifest_path.write_text(json.dumps(previous, indent=1) + "\n")
    todo = [i for i in range(s.shards) if not _shard_path(out, i).is_file()]
    started = time.perf_counter()
    made = 0

    def record() -> dict:
        """The manifest as of now, written after every shard so that a killed run keeps its time."""
        wall = time.perf_counter() - started
        shards = len(_shard_files(out))  # a run that asked for fewer tokens keeps a longer run's shards
        manifest = {"target": str(target_dir), "settings": asdict(s), "rows": shards * s.shard_rows,
                    "row_length": s.prompt_len + s.new_tokens, "target_tokens": shards * s.shard_rows * s.new_tokens,
                    "wall_s": previous["wall_s"] + wall, "tokens_per_s_last_run": made / wall if made else None}
        manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest

    columns = (TextColumn("[bold]self-distillation"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[tps]:.0f} tok/s"), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task("shards", total=s.shards, completed=s.shards - len(todo), tps=0.0)
        for done, index in enumerate(todo, start=1):
            rows = _make_shard(loaded.model, data.train, s, index)
            tmp = _shard_path(out, index).with_suffix(".tmp.npy")
            np.save(tmp, rows)
            os.replace(tmp, _shard_path(out, index))  # a shard exists only once it is complete
            made += s.shard_rows * s.new_tokens
            tps = made / (time.perf_counter() - started)
            record()
            bar.update(task, advance=1, tps=tps)
            log_milestone(bar, done, len(todo), started, f"shards of self-distillation, {tps:.0f} tok/s")
    return record()


def load_rows(folder: Path) -> Tensor:
    """All rows of a self-distillation folder as one [N, L] tensor."""
    folder = Path(folder)
    shards = _shard_files(folder)
    if not (folder / MANIFEST_FILE).is_file() or not shards:
        raise FailfastError(f"{folder} holds no self-distillation rows; run `failfast train selfdistill` first")
    return torch.from_numpy(np.concatenate([np.load(p) for p in shards]).astype(np.int64))
