"""Bad input gets its own exception type and a message naming the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from failfast import (CheckpointError, FailFast, Fixed, GenerationInputError, IncompatibleModelsError,
                      PolicyError, SpeculativeEngine, load_model, make_drafter)
from failfast.cli import main
from tests.helpers import tiny_config, write_model


@pytest.fixture
def target(target_dir):
    return load_model(target_dir, dtype=torch.float64)


def test_empty_prompt(target):
    with pytest.raises(GenerationInputError, match="prompt is empty"):
        SpeculativeEngine(target).generate([], 5)


def test_context_overflow(target):
    with pytest.raises(GenerationInputError, match="exceeds the target's context of 256"):
        SpeculativeEngine(target).generate([3] * 200, 57)


def test_vocabulary_mismatch(target, tmp_path):
    other = load_model(write_model(tmp_path / "small-vocab", tiny_config(vocab_size=80), seed=1))
    with pytest.raises(IncompatibleModelsError, match="vocabulary size 80 differs"):
        make_drafter(target, other)


def test_block_diffusion_drafter_without_mask_token(target, tmp_path):
    folder = write_model(tmp_path / "no-mask", tiny_config(block_size=8, sub_block_size=4), seed=1)
    with pytest.raises(IncompatibleModelsError, match="mask_token_id"):
        make_drafter(target, load_model(folder))


@pytest.mark.parametrize("kwargs, message", [
    (dict(unmask_threshold=1.5), "unmask threshold"), (dict(denoise="half-block"), "denoising pass"),
    (dict(sub_block_size=3, denoise="prefix"), "must divide the block size 8"), (dict(sub_block_size=16, denoise="prefix"), "must divide"),
    (dict(sub_block_size=16), "sliding window must hold 1 to 8"),
])
def test_bad_block_diffusion_options(target, tmp_path, kwargs, message):
    folder = write_model(tmp_path / "dllm", tiny_config(mask_token_id=95, block_size=8, sub_block_size=4), seed=1)
    with pytest.raises(PolicyError, match=message):
        make_drafter(target, load_model(folder), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tau=1.5), "tau must be in"), (dict(tau=-0.1), "tau must be in"),
    (dict(chunk=0), ">= 1"), (dict(max_draft=0, chunk=1), ">= 1"),
    (dict(chunk=20, max_draft=10), "must not exceed"),
])
def test_bad_failfast_parameters(kwargs, message):
    with pytest.raises(PolicyError, match=message):
        FailFast(**kwargs)


def test_bad_fixed_length():
    with pytest.raises(PolicyError, match="k must be >= 1"):
        Fixed(0)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_missing_weights(target_dir):
    (target_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(target_dir)


def test_truncated_weights(target_dir):
    data = (target_dir / "model.safetensors").read_bytes()
    (target_dir / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(target_dir)


def test_pickle_weights_are_refused(target_dir):
    (target_dir / "model.safetensors").unlink()
    (target_dir / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_model(target_dir)


def test_sharded_checkpoint_loads(target_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    state = load_file(str(target_dir / "model.safetensors"))
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(target_dir / "config.json", sharded)
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(sharded / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    a, b = load_model(target_dir), load_model(sharded)
    for k, v in a.model.state_dict().items():
        assert torch.equal(v, b.model.state_dict()[k])
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="lacks shard files"):
        load_model(sharded)


@pytest.mark.parametrize("args_fn, message", [
    (lambda d: ["--target", str(d / "nowhere"), "--prompt-ids", "1,2"], "does not exist"),
    (lambda d: ["--target", str(d / "target"), "--prompt-ids", ""], "prompt is empty"),
    (lambda d: ["--target", str(d / "target"), "--prompt-ids", "1,2", "--max-new-tokens", "999"], "context"),
    (lambda d: ["--target", str(d / "target"), "--drafter", str(d / "target"), "--tau", "2", "--prompt-ids", "3"],
     "tau"),
    (lambda d: ["--target", str(d / "target"), "--policy", "fixed", "--prompt-ids", "3"], "needs --drafter"),
    (lambda d: ["--target", str(d / "target"), "--prompt", "hello"], "no tokenizer.json"),
    (lambda d: ["--target", str(d / "target"), "--prompt-ids", "3", "--device", "gpu"], "unknown device"),
    (lambda d: ["--target", str(d / "target"), "--prompt-ids", "3", "--device", "xpu"], "not supported"),
    pytest.param(lambda d: ["--target", str(d / "target"), "--prompt-ids", "3", "--device", "cuda"],
                 "no usable CUDA GPU", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="has CUDA")),
])
def test_cli_prints_one_readable_line_and_exits_nonzero(target_dir, capsys, args_fn, message):
    code = main(["generate", "--max-new-tokens", "5", *args_fn(target_dir.parent)])  # later flags win
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err
