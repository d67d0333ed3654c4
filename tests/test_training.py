"""Smoke runs of every training stage on a tiny corpus; resumption; bad input."""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from failfast import CheckpointError, FailfastError, Fixed, SpeculativeEngine, load_model, make_drafter
from failfast.cli import main
from failfast.train.corpus import CorpusError, split_corpus
from failfast.train.data import PreparedData, prepare_data, windows
from failfast.train.loop import TrainSettings, export_resume_point, lr_at, train
from failfast.train.objectives import ar_loss, block_diffusion_loss, block_masks, masked_rank_in_block, teacher_probs
from failfast.train.recipe import convert_to_diffusion, new_model, train_ar, train_causal_windows
from failfast.train.selfdistill import SelfDistillSettings, generate_self_distillation, load_rows

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
    return TrainSettings(steps=steps, batch_size=4, seq_len=48, lr=3e-3, warmup=2, save_every=5, eval_batches=2,
                         compile=False)


def test_split_is_deterministic_and_holds_out_files(data_dir):
    manifest = json.loads((data_dir / "manifest.json").read_text())
    assert manifest["train_tokens"] > 1000 and manifest["vocab_size"] <= 300
    split = split_corpus(Path(manifest["corpus_root"]))
    assert [p.relative_to(split.root).as_posix() for p in split.held_out] == manifest["held_out_files"]
    assert split_corpus(split.root) == split


def test_installed_packages_join_the_corpus_and_keep_the_stdlib_split(data_dir, tmp_path, monkeypatch):
    """`--packages`: a package's files join train and held-out under `<package>/<path>` names,
    the stdlib part splits as before, the manifest names the packages, and `--tokenizer` keeps
    a model's vocabulary instead of training a new one."""
    site = tmp_path / "site"
    for i in range(60):
        module = site / "fakepkg" / "sub" / f"m{i}.py"
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text(SOURCE.replace("Counter", f"Counter{i}"))
    monkeypatch.syspath_prepend(str(site))
    manifest = json.loads((data_dir / "manifest.json").read_text())
    out = tmp_path / "data"
    assert main(["train", "data", "--out", str(out), "--corpus", manifest["corpus_root"], "--packages", "fakepkg",
                 "--tokenizer", str(data_dir / "tokenizer.json")]) == 0
    mixed = json.loads((out / "manifest.json").read_text())
    assert mixed["packages"] == [{"name": "fakepkg", "version": None, "files": 60}]
    assert mixed["train_files"] + len(mixed["held_out_files"]) == manifest["train_files"] + len(manifest["held_out_files"]) + 60
    held_package = [n for n in mixed["held_out_files"] if n.startswith("fakepkg/sub/")]
    assert held_package and [n for n in mixed["held_out_files"] if n not in held_package] == manifest["held_out_files"]
    assert mixed["train_tokens"] > manifest["train_tokens"]
    assert (out / "tokenizer.json").read_text() == (data_dir / "tokenizer.json").read_text()
    with pytest.raises(CorpusError, match="not installed"):
        split_corpus(Path(manifest["corpus_root"]), ["no_such_package_here"])
    # from a `pip install --target` folder: the same files, and the version its metadata pins
    (site / "fakepkg-1.2.dist-info").mkdir()
    (site / "fakepkg-1.2.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.2\n")
    pinned = split_corpus(Path(manifest["corpus_root"]), ["fakepkg"], packages_from=site)
    assert pinned.packages[0].version == "1.2" and pinned.held_out == split_corpus(
        Path(manifest["corpus_root"]), ["fakepkg"]).held_out


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


def test_causal_window_stage_learns_and_names_its_mode(data_dir, tmp_path):
    from failfast.drafters.causal_window import CausalWindowDrafter

    train_ar(data_dir, tmp_path / "ar", "tiny", _settings(10))
    report = train_causal_windows(tmp_path / "ar", data_dir, tmp_path / "cw", _settings(20), masks=2, anchor_share=3)
    losses = [h["loss"] for h in report["history"]]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    assert report["objective"] == {"window_masks": 2, "anchor_share": 3}
    target, drafter = load_model(tmp_path / "ar"), load_model(tmp_path / "cw")
    assert drafter.config.failfast_denoise == "causal" and drafter.config.mask_token_id is not None
    prompt = target.tokenizer.encode("def add3(a, b):")
    plain = SpeculativeEngine(target).generate(prompt, 20).token_ids
    made = make_drafter(target, drafter)
    assert isinstance(made, CausalWindowDrafter)
    assert SpeculativeEngine(target, made, Fixed(3)).generate(prompt, 20).token_ids == plain
    # training it back to block diffusion drops the causal mode it started from
    convert_to_diffusion(tmp_path / "cw", data_dir, tmp_path / "back", _settings(2), block_size=8, sub_block_size=4)
    assert load_model(tmp_path / "back").config.failfast_denoise is None
    with pytest.raises(FailfastError, match="window masks need"):
        train_causal_windows(tmp_path / "ar", data_dir, tmp_path / "long", _settings(2), masks=47)


def _killed_at_call(n: int):
    """The AR loss, but the run is killed (KeyboardInterrupt) at its n-th call."""
    calls = 0

    def loss(model, batch, gen):
        nonlocal calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt
        return ar_loss(model, batch, gen)
    return loss


def test_resume_continues_from_the_checkpoint(data_dir, tmp_path):
    data = PreparedData.load(data_dir)
    straight = train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=0), ar_loss, data.train, data.held_out,
                     _settings(12), tmp_path / "straight", None)
    with pytest.raises(KeyboardInterrupt):  # killed at step 8, after its checkpoint at step 5
        train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=0), _killed_at_call(8), data.train,
              data.held_out, _settings(12), tmp_path / "resumed", None)
    resumed = train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=1), ar_loss, data.train, data.held_out,
                    _settings(12), tmp_path / "resumed", None, resume=True)
    assert resumed["steps"] == 12 and len(resumed["history"]) == 12
    assert [h["loss"] for h in resumed["history"]] == pytest.approx([h["loss"] for h in straight["history"]], rel=1e-4)


def test_a_session_resumes_from_exported_16_bit_weights(data_dir, tmp_path):
    data = PreparedData.load(data_dir)
    first = lambda: new_model("tiny", data.tokenizer.vocab_size, 0, seed=0)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):  # killed at step 11, after its checkpoint at step 10
        train(first(), _killed_at_call(11), data.train, data.held_out, _settings(16), tmp_path / "run", None)
    export_resume_point(tmp_path / "run" / "checkpoint", tmp_path / "shipped")   # step 10, no optimizer state
    assert not (tmp_path / "shipped" / "optimizer.safetensors").exists()
    assert json.loads((tmp_path / "shipped" / "config.json").read_text())["torch_dtype"] == "float16"
    resumed = train(first(), ar_loss, data.train, data.held_out, _settings(16), tmp_path / "next-session", None,
                    resume=True, resume_from=tmp_path / "shipped")
    assert resumed["steps"] == 16 and len(resumed["history"]) == 16 and resumed["fresh_optimizer_at"] == 10
    assert resumed["wall_s_total"] > resumed["wall_s_this_run"]
    settings = _settings(16)
    assert lr_at(10, settings, 10) == pytest.approx(lr_at(10, settings) / settings.warmup)  # warms up again
    assert lr_at(12, settings, 10) == pytest.approx(lr_at(12, settings))
    # the weights continued: the first resumed loss is close to the last one before the stop
    assert abs(resumed["history"][10]["loss"] - resumed["history"][9]["loss"]) < 0.3


def test_compiled_training_matches_eager_losses(data_dir, tmp_path):
    data = PreparedData.load(data_dir)
    runs = [train(new_model("tiny", data.tokenizer.vocab_size, 0, seed=0), ar_loss, data.train, data.held_out,
                  replace(_settings(3), compile=compiled), tmp_path / str(compiled), None) for compiled in (False, True)]
    assert [h["loss"] for h in runs[1]["history"]] == pytest.approx([h["loss"] for h in runs[0]["history"]], rel=1e-3)


def test_bf16_autocast_is_used_only_where_native(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr("failfast.train.loop.has_native_bf16", lambda device: False)
    assert not TrainSettings(1, 1, 8).uses_bf16(cpu) and TrainSettings(1, 1, 8, precision="bf16").uses_bf16(cpu)
    monkeypatch.setattr("failfast.train.loop.has_native_bf16", lambda device: True)
    assert TrainSettings(1, 1, 8).uses_bf16(cpu) and not TrainSettings(1, 1, 8, precision="fp32").uses_bf16(cpu)
    with pytest.raises(FailfastError, match="precision"):
        TrainSettings(1, 1, 8, precision="fp8")


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
    common = ["--data", str(data_dir), "--steps", "4", "--batch-size", "2", "--seq-len", "32", "--save-every", "2",
              "--no-compile"]
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
    assert main(["train", "causal-windows", "--init", str(tmp_path / "dllm"), "--out", str(tmp_path / "cw"),
                 "--window-masks", "2", *common]) == 0
    assert json.loads((tmp_path / "cw" / "config.json").read_text())["failfast_denoise"] == "causal"
    assert main(["train", "causal-windows", "--out", str(tmp_path / "cw2"), *common]) == 2  # no --init
    assert main(["train", "diffusion", "--init", str(tmp_path / "ar"), "--out", str(tmp_path / "bad"),
                 "--block-size", "8", "--sub-block-size", "3", *common]) == 2


def test_self_distillation_rows_are_the_targets_own_continuations(data_dir, tmp_path):
    train_ar(data_dir, tmp_path / "target", "tiny", _settings(20))
    settings = SelfDistillSettings(tokens=2 * 3 * 12, prompt_len=8, new_tokens=12, batch_size=3, shard_batches=1,
                                   sampled_share=0.5, temperature=1.0, seed=3)
    manifest = generate_self_distillation(tmp_path / "target", data_dir, tmp_path / "sd", settings)
    assert manifest["rows"] == 6 and manifest["target_tokens"] == 72 and settings.shards == 2
    rows = load_rows(tmp_path / "sd")
    assert rows.shape == (6, 20)
    target = load_model(tmp_path / "target", dtype=torch.float32)
    corpus = " ".join(map(str, PreparedData.load(data_dir).train.tolist()))
    greedy = 0
    for row in rows.tolist():
        assert " ".join(map(str, row[:8])) in corpus  # the prompt is a corpus window
        own = SpeculativeEngine(target).generate(row[:8], 12).token_ids
        greedy += row[8:] == own[:12] or (0 in own and row[8:8 + len(own)] == own)
    assert 1 <= greedy < 6  # greedy rows reproduce the target; sampled rows (about half) differ
    # A lost shard is regenerated identically; more tokens add shards and keep the others;
    # other settings in the same folder are refused.
    first = (tmp_path / "sd" / "rows-00000.npy").read_bytes()
    (tmp_path / "sd" / "rows-00000.npy").unlink()
    generate_self_distillation(tmp_path / "target", data_dir, tmp_path / "sd", settings)
    assert (tmp_path / "sd" / "rows-00000.npy").read_bytes() == first
    grown = generate_self_distillation(tmp_path / "target", data_dir, tmp_path / "sd", replace(settings, tokens=108))
    assert grown["rows"] == 9 and torch.equal(load_rows(tmp_path / "sd")[:6], rows)
    with pytest.raises(FailfastError, match="other settings"):
        generate_self_distillation(tmp_path / "target", data_dir, tmp_path / "sd", replace(settings, seed=4))
    # Drafters train on the rows: windows never cross rows, and the losses fall.
    student = train_ar(data_dir, tmp_path / "student", "tiny", replace(_settings(15), seq_len=16),
                       rows=tmp_path / "sd")
    assert student["objective"] == {"rows": str(tmp_path / "sd")}
    assert student["history"][-1]["loss"] < student["history"][0]["loss"]
    window = windows(rows, 4, 16, torch.Generator().manual_seed(0))
    assert all(any(" ".join(map(str, w)) in " ".join(map(str, r)) for r in rows.tolist()) for w in window.tolist())


def test_position_decay_weights_a_blocks_first_masked_tokens_most():
    masks = torch.tensor([[0, 1, 0, 1, 1, 1, 0, 0, 1, 1]], dtype=torch.bool)
    assert masked_rank_in_block(masks, 4).tolist() == [[0, 1, 1, 2, 1, 2, 2, 2, 1, 2]]
    model = new_model("tiny", 300, 0, seed=0)
    tokens = torch.randint(2, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = block_diffusion_loss(model, tokens, 8, 1, torch.Generator().manual_seed(1))
        huge_gamma = block_diffusion_loss(model, tokens, 8, 1, torch.Generator().manual_seed(1), decay_gamma=1e9)
        decayed = block_diffusion_loss(model, tokens, 8, 1, torch.Generator().manual_seed(1), decay_gamma=1.0)
    assert float(huge_gamma) == pytest.approx(float(plain), rel=1e-5)  # no decay: the plain mean
    assert float(decayed) != pytest.approx(float(plain), rel=1e-3)


@pytest.mark.parametrize("stage", ["dflash", "eagle3"])
def test_feature_drafter_stages_train_on_the_draft_vocabulary_and_continue(data_dir, tmp_path, capsys, stage):
    train_ar(data_dir, tmp_path / "target", "tiny", _settings(10))
    sd = SelfDistillSettings(tokens=8 * 40, prompt_len=8, new_tokens=40, batch_size=4, shard_batches=1,
                             sampled_share=0.0, temperature=1.0, seed=0)
    generate_self_distillation(tmp_path / "target", data_dir, tmp_path / "sd", sd)
    shape = ["--block-size", "4"] if stage == "dflash" else []
    common = ["--target", str(tmp_path / "target"), "--rows", str(tmp_path / "sd"), "--data", str(data_dir),
              "--steps", "3", "--batch-size", "2", "--seq-len", "48", "--save-every", "3", "--no-compile"]
    assert main(["train", stage, "--out", str(tmp_path / "d1"), "--draft-vocab-size", "40", *common, *shape]) == 0
    vocab = json.loads((tmp_path / "d1" / "draft_vocab.json").read_text())
    report = json.loads((tmp_path / "d1" / "training.json").read_text())
    assert vocab["size"] == 40 and report["objective"]["draft_vocab_size"] == 40
    assert report["history"][-1]["loss"] > 0
    first = load_model(tmp_path / "d1").config
    assert first.is_dflash == (stage == "dflash") and first.is_eagle3 == (stage == "eagle3")
    # continuing a trained drafter keeps its shape; another shape, or another kind, is refused
    assert main(["train", stage, "--out", str(tmp_path / "d2"), "--init", str(tmp_path / "d1"), *common]) == 0
    assert load_model(tmp_path / "d2").config.target_layer_ids == first.target_layer_ids
    assert json.loads((tmp_path / "d2" / "training.json").read_text())["objective"]["draft_vocab_size"] is None  # 2048 > 300
    capsys.readouterr()
    assert main(["train", stage, "--out", str(tmp_path / "d3"), "--init", str(tmp_path / "d1"),
                 "--target-layers", "1", *common]) == 2
    assert f"target layer ids {first.target_layer_ids}, not the (1,) asked for" in capsys.readouterr().err
    assert main(["train", stage, "--out", str(tmp_path / "d4"), "--init", str(tmp_path / "target"), *common]) == 2
    assert "drafter" in capsys.readouterr().err


def test_dflash_loss_on_a_draft_vocabulary_ignores_tokens_outside_it(data_dir, tmp_path):
    from failfast.model.dflash import DFlashModel
    from failfast.train.dflash import dflash_loss, new_dflash

    target = new_model("tiny", 300, 1, seed=0)
    drafter: DFlashModel = new_dflash(target.config, 1, (0,), 4, 1, seed=0)
    drafter.attach(target.model.embed_tokens, target.lm_head)
    tokens = torch.randint(2, 300, (2, 40), generator=torch.Generator().manual_seed(0))

    def loss(vocab: torch.Tensor | None) -> float:
        with torch.no_grad():
            return float(dflash_loss(drafter, target, tokens, torch.Generator().manual_seed(1), 8, vocab=vocab))
    assert loss(torch.arange(300)) == pytest.approx(loss(None), rel=1e-5)  # every token: the full head
    # a vocabulary of the labels alone: a softmax over fewer rows, so a lower loss, still finite
    assert 0 < loss(tokens.unique()) < loss(None)
    assert loss(torch.tensor([0, 1])) == 0  # no label inside: nothing to learn, and no NaN


@pytest.mark.parametrize("stage", ["dflash", "eagle3"])
def test_soft_labels_are_the_targets_distribution_at_each_labels_position(stage):
    """With a near-one-hot target (its head scaled up) and rows that are its own greedy
    continuations, the soft labels put all mass on the rows' tokens: the soft loss equals the
    hard one. A teacher read one position off would predict other tokens and differ."""
    from failfast.train.dflash import dflash_loss, new_dflash
    from failfast.train.eagle3 import eagle3_loss, new_eagle3

    target = new_model("tiny", 300, 1, seed=0).double()
    with torch.no_grad():
        target.model.norm.weight.mul_(1e5)  # logits x 1e5: near-one-hot distributions
        for p in target.model.layers.parameters():  # layers that outweigh the tied embedding, so that
            p.mul_(3)                               # the continuation does not just repeat a token
        tokens = torch.randint(2, 300, (2, 8), generator=torch.Generator().manual_seed(0))
        for _ in range(32):  # greedy continuation, as self-distillation writes it
            final = target.tapped(tokens, (0,))[0][:, -1]
            tokens = torch.cat([tokens, target.lm_head(final).argmax(-1, keepdim=True)], dim=1)
    layers = (0,)
    if stage == "dflash":
        drafter = new_dflash(target.config, 1, layers, 4, 1, seed=0).double()
        loss = lambda soft: dflash_loss(drafter, target, tokens, torch.Generator().manual_seed(1), 8,  # noqa: E731
                                        soft_labels=soft)
    else:
        drafter = new_eagle3(target.config, layers, seed=0).double()
        loss = lambda soft: eagle3_loss(drafter, target, tokens, 8, soft_labels=soft)  # noqa: E731
    drafter.attach(target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        hard, soft = float(loss(False)), float(loss(True))
    assert soft == pytest.approx(hard, rel=1e-6)
    assert hard > 0.5  # an untrained drafter: the equality is not 0 == 0
