"""Copy trained models from runs/ into the package with model cards (16-bit weights).

A stage whose runs/ folder is gone (a fresh checkout that trained only a later stage) keeps
its row from the shipped card; a stage neither on disk nor in the card has not been trained
yet and is left out. A model's weights come from its latest recorded stage: from runs/ if
that stage finished there, else the shipped weights.

    python scripts/ship_models.py [--runs runs] [--evaluation runs/evaluation.json]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from failfast import load_model
from failfast.drafters.factory import DRAFT_VOCAB_FILE
from failfast.model.checkpoint import save_model
from failfast.embedded import CORPUS_MANIFEST, MODELS_DIR

# Each shipped model: a description and the training stages that made it, in order
# (name, runs/ folder); the latest stage that was trained holds the shipped weights.
STAGES = {
    "target": ("AR target", [("pre-training", "target"), ("continued training", "target-v2")]),
    "ar-drafter": ("AR drafter (classic speculative-decoding baseline), distilled from the target",
                   [("pre-training", "drafter-ar-base"), ("distillation from the first target", "drafter-ar"),
                    ("training on the target's self-distilled continuations", "drafter-ar-sd"),
                    ("more training on all self-distilled continuations", "drafter-ar-sd2")]),
    "dllm-drafter": ("mask-token drafter converted from the AR drafter (Fast-dLLM v2 recipe), distilled from the "
                     "target, trained for block diffusion and then for causal windows (its default mode)",
                     [("AR pre-training", "drafter-ar-base"), ("AR distillation from the first target", "drafter-ar"),
                      ("block-diffusion conversion, distilled from the first target", "drafter-dllm"),
                      ("block-diffusion training, distilled from the first target", "drafter-dllm-long"),
                      ("block diffusion on the target's self-distilled continuations", "drafter-dllm-sd"),
                      ("more block diffusion on all self-distilled continuations", "drafter-dllm-sd2"),
                      ("a second pass over the self-distilled continuations (seed 1)", "drafter-dllm-sd3"),
                      ("a third pass, on all 148 shards of continuations (seed 2, peak lr 7e-4)", "drafter-dllm-sd4"),
                      ("a fourth pass: suffix masks for half the blocks, position decay gamma 4 (seed 3)",
                       "drafter-dllm-sd5"),
                      ("a fifth pass: suffix masks for three blocks in four (seed 5, peak lr 5e-4)",
                       "drafter-dllm-sd6"),
                      ("causal windows: every next token and windows of 3 masks, a probe (seed 11)",
                       "drafter-dllm-cw1"),
                      ("causal windows continued (seed 12)", "drafter-dllm-cw2")]),
    "dflash-drafter": ("DFlash-style block drafter: reads the target's layer outputs, shares its embedding and "
                       "output head (z-lab's DFlashDraftModel layout)",
                       [("DFlash training on the target's self-distilled continuations", "dflash-drafter"),
                        ("continued: 12 first-pass windows per row, loss on the draft vocabulary", "dflash-drafter-v2"),
                        ("a third pass over the self-distilled continuations (seed 1, peak lr 6e-4)",
                         "dflash-drafter-v3"),
                        ("a fourth pass, on all 148 shards of continuations (seed 3, peak lr 5e-4)",
                         "dflash-drafter-v4"),
                        ("a fifth pass, 1000 steps (seed 4, peak lr 4e-4)", "dflash-drafter-v5")]),
    "eagle3-drafter": ("EAGLE-3-style chain drafter: one layer over the target's fused layer outputs and the token "
                       "embedding, shares the target's embedding and output head",
                       [("EAGLE-3 training (training-time test) on the target's self-distilled continuations",
                         "eagle3-drafter"),
                        ("continued for 1400 steps (seed 1, peak lr 6e-4)", "eagle3-drafter-v2"),
                        ("a third pass, 2000 steps (seed 2, peak lr 5e-4)", "eagle3-drafter-v3")]),
}
SHARD_BYTES = 16 * 2**20  # keep every shipped file small


def finished(run: Path) -> bool:
    return (run / "training.json").is_file() and (run / "config.json").is_file()


def stage_row(name: str, stage: str, run: Path) -> str | None:
    if not finished(run):
        return shipped_row(name, stage)
    report = json.loads((run / "training.json").read_text())
    s = report["settings"]
    objective = "".join(f"; {key.replace('_', ' ')} {value}" for key, value in report.get("objective", {}).items())
    return (
        f"| {stage} | {report['steps']} steps x batch {s['batch_size']} x {s['seq_len']} tokens = "
        f"{report['tokens_seen']:,} tokens; AdamW, peak lr {s['lr']}, warm-up {s['warmup']}, cosine, seed {s['seed']}"
        f"{objective}; final train loss {report['final_train_loss']:.3f} (mean of the last 20 steps), held-out loss "
        f"{report['held_out_loss']:.3f}; {_wall(report)} on a 2-core CPU |"
    )


def _wall(report: dict) -> str:
    """Training time of a stage, over all the pieces it ran in when it was resumed."""
    total, last = report.get("wall_s_total", report["wall_s_this_run"]), report["wall_s_this_run"]
    if total - last < 1:
        return f"{total / 60:.1f} min"
    return f"{total / 60:.1f} min in all ({last / 60:.1f} min in the last piece)"


def shipped_row(name: str, stage: str) -> str | None:
    """The stage's row in the model's shipped card (the record of a run no longer on disk),
    or None if the stage has never been trained."""
    shipped = MODELS_DIR / name / "README.md"
    lines = shipped.read_text().splitlines() if shipped.is_file() else []
    return next((line for line in lines if line.startswith(f"| {stage} |")), None)


def weights_folder(name: str, stages: list[tuple[str, str]], runs: Path) -> Path:
    """The latest recorded stage's run if it finished on disk, else the shipped model."""
    recorded = [run for stage, run in stages if finished(runs / run) or shipped_row(name, stage) is not None]
    if not recorded:
        raise SystemExit(f"{name}: no stage trained (nothing under {runs}, no shipped card)")
    return runs / recorded[-1] if finished(runs / recorded[-1]) else MODELS_DIR / name


def card(name: str, title: str, stages: list[tuple[str, str]], runs: Path, manifest: dict,
         evaluation: dict | None) -> str:
    loaded = load_model(weights_folder(name, stages, runs))
    cfg = loaded.config
    params = sum(p.numel() for p in loaded.model.parameters())
    family = "Qwen3 decoder layers" if cfg.qk_norm else "Qwen2 architecture"
    lines = [
        f"# failfast embedded model: {name}",
        "",
        f"{title}. {family}, trained from scratch by failfast on CPU.",
        "",
        "| | |", "|---|---|",
        f"| parameters | {params / 1e6:.2f}M "
        f"({'plus the target embedding and head it shares' if cfg.reads_target else 'tied input/output embeddings'}) |",
        f"| shape | {cfg.num_hidden_layers} layer{'s' if cfg.num_hidden_layers != 1 else ''}, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, "
        f"{cfg.num_attention_heads} heads / {cfg.num_key_value_heads} KV heads, context {cfg.max_position_embeddings} |",
        f"| vocabulary | {cfg.vocab_size} (byte-level BPE on the corpus; `<|endoftext|>` id {cfg.eos_token_ids[0]}, "
        f"`<|mask|>` id {loaded.tokenizer.token_id('<|mask|>')}) |",
    ]
    if cfg.is_dflash:
        lines.append(f"| DFlash | block size {cfg.block_size}, mask token id {cfg.mask_token_id}, reads target layers "
                     f"{', '.join(map(str, cfg.target_layer_ids))} |")
    elif cfg.is_eagle3:
        lines.append(f"| EAGLE-3 | one layer, reads target layers {', '.join(map(str, cfg.target_layer_ids))} |")
    elif cfg.block_size:
        lines.append(f"| block diffusion | block size {cfg.block_size}, sub-block {cfg.sub_block_size}, "
                     f"mask token id {cfg.mask_token_id} |")
    lines.append(f"| data | Python {platform.python_version()} standard library source: {manifest['train_files']} "
                 f"files, {manifest['train_tokens']:,} tokens; {len(manifest['held_out_files'])} files "
                 f"({manifest['held_out_tokens']:,} tokens) held out by path hash |")
    for stage, run_name in stages:
        if (row := stage_row(name, stage, runs / run_name)) is not None:
            lines.append(row)
    lines.append("| weights | float16 safetensors |")
    if any("distil" in stage for stage, _ in stages):
        lines += ["", "Losses of distilled stages are cross-entropies against the target's next-token "
                      "distributions; they include the target's own entropy, so they are not comparable with "
                      "next-token losses."]
    lines += [
        "",
        "Reproduce: `make models` (each stage is a Makefile target `runs/<stage folder>/training.json` "
        f"with its exact flags; this model's stages: {', '.join(f'`runs/{r}`' for _, r in stages)}; "
        "those without a row above are not trained yet).",
    ]
    if evaluation and name == "target":
        lines += ["", "## Held-out evaluation (`python scripts/evaluate_embedded.py`)", "",
                  f"- held-out loss: {evaluation['target_held_out_loss']:.3f} nats/token",
                  f"- greedy FailFast with the embedded block-diffusion drafter on {evaluation['functions']} held-out "
                  f"stdlib functions ({evaluation['max_new_tokens']} new tokens): "
                  f"{evaluation['failfast_tokens_per_target_forward']:.2f} tokens committed per target forward",
                  f"- repeated 4-grams in the target's own greedy output: "
                  f"{100 * evaluation['target_repeated_4gram_share']:.1f}% (real held-out code windows of the "
                  f"same length: {100 * evaluation['held_out_code_repeated_4gram_share']:.1f}%)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--evaluation", type=Path)
    args = parser.parse_args()
    manifest = json.loads((args.runs / "data" / "manifest.json").read_text())
    manifest.pop("corpus_root", None)
    manifest["python_version"] = platform.python_version()
    evaluation = json.loads(args.evaluation.read_text()) if args.evaluation else None
    MODELS_DIR.mkdir(exist_ok=True)
    CORPUS_MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    for name, (title, stages) in STAGES.items():
        source, dest = weights_folder(name, stages, args.runs), MODELS_DIR / name
        text = card(name, title, stages, args.runs, manifest, evaluation)
        if source != dest:
            loaded = load_model(source)
            save_model(loaded.model, dest, dtype=torch.float16, tokenizer=loaded.tokenizer,
                       max_shard_bytes=SHARD_BYTES)
            vocab = source / DRAFT_VOCAB_FILE
            if vocab.is_file():  # the drafter's reduced vocabulary travels with its weights
                (dest / DRAFT_VOCAB_FILE).write_text(vocab.read_text())
        (dest / "README.md").write_text(text)
        print(f"shipped {source} -> {dest}")


if __name__ == "__main__":
    main()
