"""A seeded, resumable training loop with a progress bar (loss, tokens/s, ETA)."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from safetensors.torch import load_file, save_file
from torch import Tensor

from failfast.errors import CheckpointError
from failfast.model import Tokenizer, Transformer
from failfast.model.checkpoint import load_model, save_model
from failfast.progress import log_milestone
from failfast.train.data import windows

LossFn = Callable[[Transformer, Tensor, torch.Generator], Tensor]
CHECKPOINT_DIR = "checkpoint"


@dataclass(frozen=True)
class TrainSettings:
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 200
    eval_batches: int = 8


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up then cosine decay to 10% of the peak."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    progress = (step - s.warmup) / max(s.steps - s.warmup, 1)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _step_generator(seed: int, step: int) -> torch.Generator:
    """Batches and masks at step s depend only on (seed, s): resuming replays the same data."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@torch.no_grad()
def evaluate(model: Transformer, loss_fn: LossFn, stream: Tensor, s: TrainSettings) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(10_007 + s.seed)
    losses = [float(loss_fn(model, windows(stream, s.batch_size, s.seq_len, gen), gen)) for _ in range(s.eval_batches)]
    model.train()
    return sum(losses) / len(losses)


def _save_checkpoint(folder: Path, model: Transformer, opt: torch.optim.AdamW, step: int,
                     history: list[dict]) -> None:
    save_model(model, folder)
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in opt.state.get(p, {}).items():
                tensors[f"{key}/{names[id(p)]}"] = value.detach().reshape(-1).clone() if value.dim() == 0 else value.detach().clone()
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "state.json").write_text(json.dumps({"step": step, "history": history}))


def _load_checkpoint(folder: Path, model: Transformer, opt: torch.optim.AdamW) -> tuple[int, list[dict]]:
    try:
        loaded = load_model(folder).model
        model.load_state_dict(loaded.state_dict())
        tensors = load_file(str(folder / "optimizer.safetensors"))
        state = json.loads((folder / "state.json").read_text())
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"cannot resume from {folder} (corrupt checkpoint?): {exc}") from None
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        field, name = key.split("/", 1)
        opt.state[params[name]][field] = value.reshape(()) if field == "step" else value
    return int(state["step"]), list(state["history"])


def train(model: Transformer, loss_fn: LossFn, train_stream: Tensor, held_out: Tensor, s: TrainSettings,
          out: Path, tokenizer: Tokenizer | None, *, resume: bool = False, label: str = "train",
          objective: dict | None = None) -> dict:
    """Train `model` in place, checkpointing under out/checkpoint; save the final model in out/
    (`objective`: the loss's own settings, recorded in training.json)."""
    out = Path(out)
    ckpt = out / CHECKPOINT_DIR
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95))
    step, history = 0, []
    if resume and (ckpt / "state.json").is_file():
        step, history = _load_checkpoint(ckpt, model, opt)
    model.train()
    started = time.perf_counter()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns) as bar:
        task = bar.add_task(label, total=s.steps, completed=step, loss=float("nan"), tps=0.0)
        while step < s.steps:
            t0 = time.perf_counter()
            gen = _step_generator(s.seed, step)
            batch = windows(train_stream, s.batch_size, s.seq_len, gen)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, s)
            loss = loss_fn(model, batch, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
            opt.step()
            step += 1
            value = loss.item()
            history.append({"step": step, "loss": value})
            tps = batch.numel() / (time.perf_counter() - t0)
            bar.update(task, advance=1, loss=value, tps=tps)
            log_milestone(bar, step, s.steps, started, f"steps of {label}: loss {value:.3f}, {tps:.0f} tok/s")
            if step % s.save_every == 0 or step == s.steps:
                _save_checkpoint(ckpt, model, opt, step, history)
    report = {
        "settings": asdict(s),
        "objective": objective or {},
        "steps": step,
        "tokens_seen": step * s.batch_size * s.seq_len,
        "final_train_loss": sum(h["loss"] for h in history[-20:]) / len(history[-20:]),
        "held_out_loss": evaluate(model, loss_fn, held_out, s),
        "wall_s_this_run": time.perf_counter() - started,
        "history": history,
    }
    model.eval()
    save_model(model, out, dtype=torch.float16, tokenizer=tokenizer)
    (out / "training.json").write_text(json.dumps(report, indent=1) + "\n")
    return report
