"""Smoke runs of every training stage on a tiny corpus; resumption; bad input."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from failfast import CheckpointError, FailfastError, Fixed, SpeculativeEngine, load_model, make_drafter
from failfast.cli import main
from failfast.train.corpus import CorpusError, split_corpus
from failfast.train.data import PreparedData, prepare_data
from failfast.train.loop import TrainSettings, train
from failfast.train.objectives import ar_loss, block_masks, teacher_probs
from failfast.train.recipe import convert_to_diffusion, new_model, train_ar

SOURCE = textwrap.dedent('''
    def add(a, b):
        """Return the sum of a and b."""
        return a + b


    class Counter:
        def __init__(self):
            self.count = 0

        def increment(self, step=1):
            self.count += step
            return self.count
''')


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    corpus = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (corpus / f"mod{i}.py").write_text(SOURCE.replace("add", f"add{i}") * 3)
    out = tmp_path_factory.mktemp("data")
    prepare_data(out, corpus, vocab_size=300)
    return out


def _settings(steps: int) -> TrainSettings:
    return TrainSettings(steps=steps, batch_size=4, seq_len=48, lr=3e-3, warmup=2, save_every=5, eval_batches=2)


def test_split_is_deterministic_and_holds_out_files(data_dir):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["train_tokens"] > 1000 and manifest["vocab_size"] <= 300
    split = split_corpus(Path(manifest["corpus_root"]))
    assert [p.relative_to(split.root).as_posix() for p in split.held_out] == manifest["held_out_files"]
    assert split_corpus(split.root) == split


def test_ar_and_diffusion_stages_learn_and_reload(data_dir, tmp_path):
    ar = train_ar(data_dir, tmp_path / "ar", "tiny", _settings(30))
    losses = [h["loss"] for h in ar["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    dllm = convert_to_diffusion(tmp_path / "ar", data_dir, tmp_path / "dllm", _settings(20), block_size=8,
                                sub_block_size=4)
    assert dllm["history"][-1]["loss"] < dllm["history"][0]["loss"]
    target, drafter = load_model(tmp_path / "ar"), load_model(tmp_path / "dllm")
    assert drafter.config.block_size == 8 and drafter.config.mask_token_id is not None
    assert json.loads((tmp_path / "dllm" / "config.json").read_text())["torch_dtype"] == "float16"
    prompt = target.tokenizer.encode("def add3(a, b):")
    plain = SpeculativeEngine(target).generate(prompt, 20).token_ids
    assert SpeculativeEngine(target, make_drafter(target, drafter), Fixed(6)).generate(prompt, 20).token_ids == plain


def test_resume_continues_from_the_checkpoint(data_dir, tmp_path):
    data = PreparedData.load(data_dir)
    straight = train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=0), ar_loss, data.train, data.held_out,
                     _settings(12), tmp_path / "straight", None)
    calls = 0

    def dies_at_step_8(model, batch, gen):
        nonlocal calls
        calls += 1
        if calls == 8:
            raise KeyboardInterrupt  # the run is killed after its checkpoint at step 5
        return ar_loss(model, batch, gen)

    with pytest.raises(KeyboardInterrupt):
        train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=0), dies_at_step_8, data.train, data.held_out,
              _settings(12), tmp_path / "resumed", None)
    resumed = train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=1), ar_loss, data.train, data.held_out,
                    _settings(12), tmp_path / "resumed", None, resume=True)
    assert resumed["steps"] == 12 and len(resumed["history"]) == 12
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in straight["history"]], rel=1e-4)


def test_empty_and_missing_corpus(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        prepare_data(tmp_path / "out", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="no non-empty .py files"):
        prepare_data(tmp_path / "out", tmp_path / "empty")
    assert main(["train", "data", "--out", str(tmp_path / "o"), "--corpus", str(tmp_path / "empty")]) == 2


def test_corrupt_checkpoint_is_refused_on_resume(data_dir, tmp_path):
    train_ar(data_dir, tmp_path / "run", "tiny", _settings(5))
    (tmp_path / "run" / "checkpoint" / "optimizer.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        train_ar(data_dir, tmp_path / "run", "tiny", _settings(10), resume=True)


def test_tokenizer_without_mask_token_is_refused(data_dir, tmp_path):
    train_ar(data_dir, tmp_path / "ar", "tiny", _settings(2))
    broken = tmp_path / "data-no-mask"
    broken.mkdir()
    for f in data_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tok = json.loads((broken / "tokenizer.json").read_text())
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["content"] != "<|mask|>"]
    tok["model"]["vocab"].pop("<|mask|>")
    (broken / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(FailfastError, match="lacks special tokens: <\\|mask\\|>"):
        convert_to_diffusion(tmp_path / "ar", broken, tmp_path / "dllm", _settings(2))


def test_unprepared_data_folder(tmp_path):
    with pytest.raises(FailfastError, match="run `failfast train data` first"):
        PreparedData.load(tmp_path)


def test_distillation_targets_are_the_teachers_distributions(data_dir):
    data = PreparedData.load(data_dir)
    model = new_model("tiny", data.tokenizer.vocab_size, 0, seed=3)
    batch = data.train[:49][None]
    with torch.no_grad():
        probs = teacher_probs(model, batch)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
        # Cross-entropy of a model against itself as teacher is its own entropy.
        assert float(ar_loss(model, batch, None, model)) == pytest.approx(float(entropy), rel=1e-5)
        assert float(ar_loss(model, batch)) != pytest.approx(float(entropy), rel=1e-3)


def test_suffix_masks_cover_each_block_from_a_cut_to_its_end():
    masks = block_masks(64, 40, 8, torch.Generator().manual_seed(0), suffix_share=1.0)
    for row in masks.tolist():
        for start in range(0, 40, 8):
            block = row[start:start + 8]
            cut = block.index(True) if True in block else 8
            assert block == [False] * cut + [True] * (8 - cut)
    assert not masks[:, 0].any()
    uniform = block_masks(64, 40, 8, torch.Generator().manual_seed(0))
    assert torch.equal(uniform, block_masks(64, 40, 8, torch.Generator().manual_seed(0), suffix_share=0.0))
    # Uniform masking rarely leaves a clean prefix followed by masks only.
    mixed = block_masks(400, 8, 8, torch.Generator().manual_seed(1), suffix_share=0.5)
    def is_suffix(row: list[bool]) -> bool:
        return row == sorted(row) and any(row)
    share = sum(map(is_suffix, mixed.tolist())) / 400
    assert 0.5 < share < 0.75
    assert sum(map(is_suffix, uniform[:, :8].tolist())) / 64 < 0.4


def test_distilled_stages_train_from_a_teacher(data_dir, tmp_path):
    train_ar(data_dir, tmp_path / "teacher", "tiny", _settings(10))
    student = train_ar(data_dir, tmp_path / "student", "tiny", _settings(15), teacher=tmp_path / "teacher")
    assert student["history"][-1]["loss"] < student["history"][0]["loss"]
    dllm = convert_to_diffusion(tmp_path / "student", data_dir, tmp_path / "dllm", _settings(10), block_size=8,
                                sub_block_size=4, teacher=tmp_path / "teacher")
    assert dllm["history"][-1]["loss"] < dllm["history"][0]["loss"]


def test_ar_training_can_continue_from_a_checkpoint(data_dir, tmp_path):
    fresh = train_ar(data_dir, tmp_path / "fresh", "tiny", _settings(30))
    again = train_ar(data_dir, tmp_path / "again", "tiny", _settings(3))
    continued = train_ar(data_dir, tmp_path / "continued", "tiny", _settings(3), init=tmp_path / "fresh")
    assert again["history"][0]["loss"] == fresh["history"][0]["loss"]  # fresh starts are seeded alike
    # Starting from the trained weights, the first loss is already far below a fresh model's.
    assert continued["history"][0]["loss"] < fresh["history"][0]["loss"] - 0.4


def test_train_cli_runs_every_stage(data_dir, tmp_path, capsys):
    common = ["--data", str(data_dir), "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--save-every", "2"]
    assert main(["train", "ar", "--size", "tiny", "--out", str(tmp_path / "ar"), *common]) == 0
    assert main(["train", "diffusion", "--init", str(tmp_path / "ar"), "--out", str(tmp_path / "dllm"),
                 "--block-size", "8", "--sub-block-size", "4", "--teacher", str(tmp_path / "ar"),
                 "--suffix-mask-share", "0.5", *common]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" in out
    assert "4/4 steps of AR -> block diffusion" in out  # a log line, not a bar, when output is not a terminal
    assert load_model(tmp_path / "dllm").config.sub_block_size == 4
    report = json.loads((tmp_path / "dllm" / "training.json").read_text())
    assert report["objective"] == {"suffix_mask_share": 0.5}
    assert main(["train", "diffusion", "--init", str(tmp_path / "ar"), "--out", str(tmp_path / "bad"),
                 "--block-size", "8", "--sub-block-size", "3", *common]) == 2
