"""The drafters that read target features (DFlash, EAGLE-3): lossless under every policy with
long accepted drafts (float64), their context caches after rollback, checkpoint layouts, the
EAGLE-3 training-time test against drafting, and clear errors for drafters that do not fit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from failfast import (CheckpointError, FailFast, Fixed, IncompatibleModelsError, SamplingParams, SpeculativeEngine, cost_aware,
                      load_model, make_drafter)
from failfast.cli import main
from failfast.decode.policies import CostAware
from failfast import GenerationRequest
from failfast.model.checkpoint import save_model
from tests.helpers import copy_checkpoint, random_model, set_eos, tiny_config, tiny_dflash_config, tiny_eagle3_config
from tests.synthetic import BLOCK
from tests.test_lossless import CPU_COSTS, hf_greedy

PROMPTS = [list(range(3, 8)), list(range(10, 18)), list(range(20, 33)), [5]]
KINDS = ["trained_dflash", "trained_eagle3"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("prompt", PROMPTS)
def test_trained_drafter_is_lossless_with_long_drafts(request, kind, prompt):
    target_dir, drafter_dir = request.getfixturevalue(kind)
    target = load_model(target_dir, dtype=torch.float64)
    expected = hf_greedy(target_dir, prompt, 90)
    for dtype in (torch.float64, torch.float32):  # a drafter in another dtype changes drafting cost only
        drafter = load_model(drafter_dir, dtype=dtype)
        for policy in (FailFast(0.45, BLOCK - 1, 40), Fixed(BLOCK - 1), Fixed(20), Fixed(3), CostAware(CPU_COSTS)):
            result = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(prompt, 90)
            assert result.token_ids == expected, (policy.name, dtype)
            if policy.name.startswith("failfast") and len(prompt) > 1:  # drafts past the first chunk are accepted
                dflash = kind == "trained_dflash"  # extension passes of a block each; EAGLE-3: a step per token
                assert max(r.accepted for r in result.stats.trajectory) >= (2 * BLOCK if dflash else BLOCK)
                assert max(r.drafter_forwards for r in result.stats.trajectory) >= (3 if dflash else BLOCK)


@pytest.mark.parametrize("kind", KINDS)
def test_eos_length_and_sampling_inside_drafts(request, kind, tmp_path):
    target_dir, drafter_dir = request.getfixturevalue(kind)
    folder = copy_checkpoint(target_dir, tmp_path / "target-eos")
    set_eos(folder, 20)  # 13 tokens after the prompt
    target = load_model(folder, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    prompt = list(range(3, 8))
    engine = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(0.0, BLOCK - 1, 40))
    result = engine.generate(prompt, 60)
    assert result.token_ids == hf_greedy(folder, prompt, 60, eos=20) and result.stop_reason == "eos"
    for max_new in (1, 2, 13):
        assert engine.generate(list(range(22, 27)), max_new).token_ids == hf_greedy(folder, list(range(22, 27)), max_new)
    plain = SpeculativeEngine(target)
    for seed in range(3):
        sampling = SamplingParams(1.0, seed=seed)
        assert engine.generate(list(range(22, 30)), 50, sampling).token_ids == \
            plain.generate(list(range(22, 30)), 50, sampling).token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_rows_in_a_batch_and_measured_costs(request, kind):
    target_dir, drafter_dir = request.getfixturevalue(kind)
    target = load_model(target_dir, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    requests = [GenerationRequest(list(range(3, 8)), 40), GenerationRequest([9], 30),
                GenerationRequest(list(range(14, 31)), 35, SamplingParams(0.8, seed=2))]
    for policy in (FailFast(0.45, BLOCK - 1, 40), cost_aware(chunk=BLOCK - 1)):
        engine = SpeculativeEngine(target, make_drafter(target, drafter), policy)
        batched = dict(engine.generate_many(requests, batch_size=3))
        for i, request in enumerate(requests):
            alone = SpeculativeEngine(target).generate(request.prompt_ids, request.max_new_tokens, request.sampling)
            assert batched[i].token_ids == alone.token_ids, (policy, i)


@pytest.mark.parametrize("kind, cached", [("random-dflash", 29), ("random-eagle3", 28)])
def test_context_cache_after_rollback_equals_a_fresh_one(random_models, kind, cached):
    """After drafting and features replaced from position 12, the drafter's cache equals one
    built from scratch (DFlash caches features 0..n-2; EAGLE-3 slots 0..n-3, its chain starts at n-2)."""
    target = load_model(random_models["target"], dtype=torch.float64)
    loaded = load_model(random_models[kind], dtype=torch.float64)
    ids = torch.randint(2, 90, (1, 30), generator=torch.Generator().manual_seed(0))[0].tolist()
    features = target.model.features(torch.tensor([ids]), loaded.config.target_layer_ids)[0]
    stale = torch.randn_like(features)
    rolled = make_drafter(target, loaded)
    rolled.prepare(40)
    rolled.add_context(0, stale[:20])
    rolled.begin(ids[:21])
    rolled.draft(5)  # whatever a round writes past the committed positions
    rolled.add_context(12, features[12:29])  # positions 12.. are replaced: a rollback to 12
    rolled.begin(ids)
    fresh = make_drafter(target, loaded)
    fresh.prepare(40)
    fresh.add_context(0, torch.cat([stale[:12], features[12:29]]))
    fresh.begin(ids)
    assert rolled.cache.length == fresh.cache.length == cached
    for layer in range(len(fresh.cache.keys)):
        torch.testing.assert_close(rolled.cache.keys[layer][:, :, :cached], fresh.cache.keys[layer][:, :, :cached])
        torch.testing.assert_close(rolled.cache.values[layer][:, :, :cached], fresh.cache.values[layer][:, :, :cached])
    assert rolled.draft(6) == fresh.draft(6)


def test_checkpoint_in_zlab_layout(tmp_path):
    target_cfg = tiny_config()
    folder = save_model(random_model(tiny_dflash_config(target_cfg, num_hidden_layers=2), seed=1), tmp_path / "d")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["block_size"] == 4 and raw["dflash_config"] == {"mask_token_id": 95, "target_layer_ids": [0, 1]}
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.0.self_attn.k_norm.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) or n.endswith("bias") for n in names)
    assert load_model(folder).config.target_layer_ids == (0, 1)


@pytest.mark.parametrize("config_of", [tiny_dflash_config, tiny_eagle3_config])
@pytest.mark.parametrize("overrides, message", [
    (dict(target_layer_ids=(0, 2)), "reads target layers"),
    (dict(hidden_size=48), "hidden size"),
])
def test_drafters_that_do_not_fit_the_target(random_models, tmp_path, config_of, overrides, message):
    target = load_model(random_models["target"], dtype=torch.float64)
    folder = save_model(random_model(config_of(target.config, **overrides), seed=2), tmp_path / "bad")
    with pytest.raises(IncompatibleModelsError, match=message):
        make_drafter(target, load_model(folder))


@pytest.mark.parametrize("kind", KINDS)
def test_cli_generates_with_the_drafter(request, kind, capsys):
    target_dir, drafter_dir = request.getfixturevalue(kind)

    def generate(*flags: str) -> list[int]:
        assert main(["generate", "--target", str(target_dir), "--prompt-ids", "3,4,5", "--max-new-tokens", "30",
                     "--json", *flags]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]
    for sampling in ([], ["--temperature", "0.8", "--seed", "3"]):
        plain = generate("--policy", "ar", *sampling)
        for policy in (["--policy", "fixed", "--k", "7"], ["--policy", "failfast", "--chunk", "7"],
                       ["--policy", "cost-aware", "--chunk", "7"]):
            assert generate("--drafter", str(drafter_dir), *policy, *sampling) == plain, (policy, sampling)


def test_eagle3_training_time_test_is_what_drafting_computes(random_models):
    """Step s of the unrolled training forward at slot j equals the s-th drafting step of a
    chain started at slot j-s over cached true slots (fed the same tokens)."""
    target = load_model(random_models["target"], dtype=torch.float64)
    model = load_model(random_models["random-eagle3"], dtype=torch.float64).model
    model.attach(target.model.model.embed_tokens, target.model.lm_head)
    tokens = torch.randint(2, 90, (2, 20), generator=torch.Generator().manual_seed(0))
    fused = model.fuse(target.model.features(tokens, model.config.target_layer_ids))
    unrolled = model.unrolled(tokens, fused, 4)
    for row in range(2):
        for start in (0, 6, 13):
            cache = model.new_cache(24)
            model.write_context(tokens[row:row + 1, 1:start + 1], fused[row:row + 1, :start], 0, cache)
            hidden = fused[row:row + 1, start:start + 1]
            for s in range(4):
                hidden = model.step(tokens[row:row + 1, start + s + 1:start + s + 2], hidden, cache)
                torch.testing.assert_close(hidden[0, 0], unrolled[s][row, start + s])


def test_eagle3_checkpoint_layout(tmp_path):
    folder = save_model(random_model(tiny_eagle3_config(tiny_config()), seed=1), tmp_path / "e")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["architectures"] == ["Eagle3DraftModel"] and raw["num_hidden_layers"] == 1
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1]} and "block_size" not in raw
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "norm.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names
    assert not any(n.startswith(("embed_tokens", "lm_head", "model.")) for n in names)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.get_tensor("midlayer.self_attn.q_proj.weight").shape[1] == 2 * 32  # embedding and feature side by side
    loaded = load_model(folder)
    assert loaded.config.is_eagle3 and loaded.config.target_layer_ids == (0, 1)
    raw["eagle_config"] = {}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        load_model(folder)
