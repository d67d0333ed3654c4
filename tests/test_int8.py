"""Int8 drafter weights: close to the float layers, and drafts from them never change the
output (a float64 target; the drafter's layers in int8, float32 otherwise)."""

from __future__ import annotations

import json

import pytest
import torch

from failfast import FailFast, Fixed, SpeculativeEngine, load_model, make_drafter
from failfast.cli import main
from failfast.decode.engine import GenerationRequest
from failfast.errors import IncompatibleModelsError
from failfast import pipeline
from failfast.model.checkpoint import read_config
from failfast.model.int8 import Int8Linear, int8_pays, quantize_drafter
from failfast.model.transformer import MLP, Attention, Linear
from tests.helpers import prompt_of


def test_an_int8_linear_computes_the_float_one_to_int8_precision():
    torch.manual_seed(0)
    layer = Linear(64, 48, bias=True)
    x = torch.randn(5, 3, 64)
    for dtype in (torch.float32, torch.bfloat16):
        exact, coarse = layer.to(dtype)(x.to(dtype)), Int8Linear(layer.to(dtype))(x.to(dtype))
        assert coarse.shape == exact.shape == (5, 3, 48) and coarse.dtype == dtype
        assert ((coarse - exact).float().norm() / exact.float().norm()) < 0.03
        assert not torch.equal(coarse, exact)  # it is quantized, not the float layer


@pytest.mark.parametrize("kind,layer_linears", [("random-dllm", 7), ("random-eagle3", 7), ("random-dflash", 7)])
def test_quantizing_swaps_every_layer_linear_and_keeps_head_and_fusion(random_models, kind, layer_linears):
    drafter = load_model(random_models[kind], dtype=torch.float32)
    swapped = quantize_drafter(drafter.model)
    assert swapped == layer_linears * max(drafter.model.config.num_hidden_layers, 1)
    kept = {name.rsplit(".", 1)[-1] for name, m in drafter.model.named_modules() if type(m) is Linear}
    assert kept <= {"lm_head", "fc"}
    assert drafter.model.dtype == torch.float32
    # q/k/v and gate/up also run as one int8 product each: the separate int8 layers' numbers
    fused = 0
    for module in drafter.model.modules():
        if isinstance(module, Attention):
            x = torch.randn(3, 5, module.q_proj.weight_int8.shape[1])
            layers, product = (module.q_proj, module.k_proj, module.v_proj), module.qkv
        elif isinstance(module, MLP):
            x = torch.randn(3, 5, module.gate_proj.weight_int8.shape[1])
            layers, product = (module.gate_proj, module.up_proj), module.gate_up
        else:
            continue
        torch.testing.assert_close(product(x), torch.cat([layer(x) for layer in layers], dim=-1))
        fused += 1
    assert fused == 2 * max(drafter.model.config.num_hidden_layers, 1)


def test_int8_needs_a_16_or_32_bit_drafter(random_models):
    with pytest.raises(IncompatibleModelsError, match="float32, bfloat16 or float16"):
        quantize_drafter(load_model(random_models["random-dllm"], dtype=torch.float64).model)


@pytest.mark.parametrize("policy", [FailFast(tau=0.45, chunk=10, max_draft=40), Fixed(6)])
def test_int8_drafters_are_lossless(random_models, trained_pair, policy):
    """The trained block-diffusion drafter (long accepted drafts) and random drafters of every
    kind, each with int8 layers, against a float64 target."""
    target_dir, drafter_dir = trained_pair
    target = load_model(target_dir, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float32)
    quantize_drafter(drafter.model)
    prompt = list(range(3, 12))
    result = SpeculativeEngine(target, make_drafter(target, drafter), policy).generate(prompt, 90)
    assert result.token_ids == SpeculativeEngine(target).generate(prompt, 90).token_ids
    assert result.stats.tokens_per_round > 4  # int8 drafts are still accepted at length
    random_target = load_model(random_models["target"], dtype=torch.float64)
    for kind in ("random-dllm", "random-ar", "random-dflash", "random-eagle3"):
        drafter = load_model(random_models[kind], dtype=torch.float32)
        quantize_drafter(drafter.model)
        engine = SpeculativeEngine(random_target, make_drafter(random_target, drafter), policy)
        for length in (1, 17):
            prompt = prompt_of(length)
            result = engine.generate(prompt, 30)
            assert result.token_ids == SpeculativeEngine(random_target).generate(prompt, 30).token_ids, (kind, length)
        # batched drafting: several rows' passes through the int8 layers in one packed forward
        prompts = [prompt_of(n, seed=n) for n in (2, 7, 13, 20)]
        together = dict(engine.generate_many([GenerationRequest(p, 24) for p in prompts], batch_size=3))
        for i, prompt in enumerate(prompts):
            assert together[i].token_ids == SpeculativeEngine(random_target).generate(prompt, 24).token_ids, kind


def test_cli_drafter_dtype_int8(random_models, capsys):
    """A float64 target: the int8 drafter computes in float32."""
    target = str(random_models["target"])
    code = main(["generate", "--target", target, "--drafter", str(random_models["random-dllm"]), "--no-lookup",
                 "--prompt-ids", "3,4,5", "--max-new-tokens", "12", "--json", "--dtype", "float64",
                 "--drafter-dtype", "int8"])
    out = json.loads(capsys.readouterr().out)
    plain = SpeculativeEngine(load_model(target, dtype=torch.float64)).generate([3, 4, 5], 12)
    assert code == 0 and out["token_ids"] == plain.token_ids and out["stats"]["drafter_forwards"] > 0


@pytest.mark.parametrize("kind, dtype, device, expected", [
    ("random-ar", torch.bfloat16, "cpu", True), ("random-dllm", torch.bfloat16, "cpu", False),
    ("random-eagle3", torch.bfloat16, "cpu", False), ("random-dflash", torch.bfloat16, "cpu", False),
    ("random-ar", torch.float32, "cpu", False), ("random-ar", torch.float64, "cpu", False),
    ("random-ar", torch.bfloat16, "cuda", False)])
def test_int8_is_the_default_only_where_it_measured_faster(random_models, kind, dtype, device, expected):
    """bfloat16 AR drafters on a CPU; never where exactness tests run (float64)."""
    assert int8_pays(read_config(random_models[kind]), dtype, device) is expected


@pytest.mark.parametrize("flag, int8", [([], True), (["--drafter-dtype", "bfloat16"], False),
                                        (["--drafter-dtype", "int8"], True)])
def test_cli_drafter_dtype_auto_picks_int8_where_it_pays(monkeypatch, random_models, capsys, flag, int8):
    """With the default --drafter-dtype auto a bfloat16 AR drafter gets int8 weights; a named
    dtype keeps its float weights."""
    loaded = []
    real = pipeline.load_drafter
    monkeypatch.setattr(pipeline, "load_drafter", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    code = main(["generate", "--target", str(random_models["target"]), "--drafter", str(random_models["random-ar"]),
                 "--no-lookup", "--prompt-ids", "3,4,5", "--max-new-tokens", "6", "--json", "--dtype", "bfloat16",
                 *flag])
    assert code == 0 and json.loads(capsys.readouterr().out)["stats"]["drafter_forwards"] > 0
    assert any(isinstance(m, Int8Linear) for m in loaded[0].model.modules()) is int8
