"""The shipped models load, are small, and generate losslessly; the default CLI uses them."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import Qwen2ForCausalLM

from failfast import FailFast, Fixed, SpeculativeEngine, drafter_failfast, load_model, make_drafter
from failfast.cli import main
from failfast.embedded import EMBEDDED, MODELS_DIR, resolve_model

PROMPTS = ["def fib(n):\n", "import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n",
           "class Stack:\n    def __init__(self):\n"]


def test_shipped_models_are_complete_16_bit_folders_under_64_mib():
    total = 0
    for name in EMBEDDED:
        folder = resolve_model(name)
        assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float16"
        assert (folder / "README.md").is_file() and (folder / "tokenizer.json").is_file()
        assert load_model(folder).config.vocab_size == 8192
        total += sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    assert total < 64 * 2**20
    assert json.loads((MODELS_DIR / "corpus.json").read_text())["held_out_files"]


@pytest.mark.parametrize("drafter_name, policy", [("dllm-drafter", FailFast()), ("dllm-drafter", drafter_failfast()),
                                                  ("dllm-drafter", Fixed(10)), ("ar-drafter", FailFast()),
                                                  ("dflash-drafter", FailFast(chunk=15)),
                                                  ("dflash-drafter", drafter_failfast()),
                                                  ("eagle3-drafter", drafter_failfast())])
def test_embedded_models_are_lossless(drafter_name, policy):
    target = load_model(resolve_model("target"), dtype=torch.float64)
    drafter = load_model(resolve_model(drafter_name), dtype=torch.float64)
    hf = Qwen2ForCausalLM.from_pretrained(resolve_model("target"), dtype=torch.float64).eval()
    for text in PROMPTS:
        ids = target.tokenizer.encode(text)
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=48, do_sample=False, eos_token_id=list(target.config.eos_token_ids),
                               pad_token_id=0)[0, len(ids):].tolist()
        got = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(ids, 48)
        assert got.token_ids == expected
        assert got.token_ids == SpeculativeEngine(target).generate(ids, 48).token_ids


def test_default_generate_uses_embedded_failfast(capsys):
    assert main(["generate", "--prompt", "def fib(n):", "--max-new-tokens", "24", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["drafter_forwards"] > 0 and out["text"] and len(out["token_ids"]) <= 24


def test_demo_prints_text_and_speedup(capsys):
    assert main(["demo", "--max-new-tokens", "24", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("def fibonacci(n):") and "speedup" in out and "tokens identical" in out


def test_sharded_save_round_trips(tmp_path):
    from failfast.model.checkpoint import save_model
    model = load_model(resolve_model("ar-drafter"))
    save_model(model.model, tmp_path, dtype=torch.float16, max_shard_bytes=2**20)
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1 and not (tmp_path / "model.safetensors").exists()
    again = load_model(tmp_path)
    for (name, a), (_, b) in zip(model.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(a, b), name
