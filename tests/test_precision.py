"""The default dtype (float32 on CPUs, bfloat16 on CUDA; --dtype wins) and 16-bit inference
whose short verification forwards round like one-token decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from failfast import GenerationInputError, load_model
from failfast.cli import main
from failfast.model import precision
from failfast.model.precision import default_dtype, resolve_dtype
from failfast.model.transformer import attention_mask, batch_invariant_attention
from tests.helpers import random_model, tiny_config


@pytest.mark.parametrize("native", [False, True])
def test_cpu_inference_defaults_to_float32_whatever_its_bf16_support(monkeypatch, native):
    """Native bf16 is detected (training uses it) but CPU inference stays float32: 16-bit
    verification is not bit-identical to one-token decoding there in general."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert precision.cpu_has_native_bf16() == native == precision.has_native_bf16("cpu")
    assert default_dtype("cpu") == torch.float32 and resolve_dtype("auto") == resolve_dtype(None) == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16 and resolve_dtype("float64") == torch.float64  # explicit wins


@pytest.mark.parametrize("bf16_supported, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_cuda_inference_defaults_to_bfloat16_where_supported(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert default_dtype("cuda") == expected and resolve_dtype("auto", "cuda") == expected


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(GenerationInputError, match="unknown dtype 'fp7'"):
        resolve_dtype("fp7")


@pytest.mark.parametrize("native, flag, expected", [(False, [], "float32"), (True, [], "float32"),
                                                    (True, ["--dtype", "bfloat16"], "bfloat16")])
def test_cli_dtype_follows_the_hardware_unless_given(monkeypatch, capsys, target_dir, native, flag, expected):
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    seen = []

    def recording_load(path, dtype, device):
        seen.append(dtype)
        return load_model(path, dtype=dtype, device=device)
    monkeypatch.setattr("failfast.pipeline.load_model", recording_load)
    code = main(["generate", "--target", str(target_dir), "--policy", "ar", "--prompt-ids", "3,4",
                 "--max-new-tokens", "2", "--json", *flag])
    assert code == 0 and json.loads(capsys.readouterr().out)["stats"]["tokens"] == 2
    assert seen == [getattr(torch, expected)]


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_batch_invariant_attention_is_attention(heads, kv_heads):
    """The 16-bit inference attention computes what SDPA computes (checked in float64)."""
    gen = torch.Generator().manual_seed(heads + kv_heads)
    q = torch.randn(2, heads, 5, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 12, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = attention_mask(torch.arange(7, 12), torch.arange(12), None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                 enable_gqa=kv_heads != heads)
    assert torch.allclose(batch_invariant_attention(q, k, v, mask), expected, atol=1e-12)
    one = batch_invariant_attention(q[:, :, :1], k[:, :, :8], v[:, :, :8], None)
    assert torch.allclose(one, expected[:, :, :1], atol=1e-12)


@pytest.mark.skipif(not precision.cpu_has_native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16 or AMX)")
def test_bf16_verification_rounds_like_one_token_decoding():
    """In bfloat16 a short k-token forward at a short context gives bit-identical logits to k
    one-token forwards (longer ones need not: README, "Precision")."""
    model = random_model(tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                     num_key_value_heads=2), seed=3).to(torch.bfloat16)
    ids = torch.randint(0, 512, (1, 120), generator=torch.Generator().manual_seed(0))
    for start in (1, 17, 64, 100):
        one_cache, many_cache = model.new_cache(128), model.new_cache(128)
        model(ids[:, :start], 0, one_cache)
        model(ids[:, :start], 0, many_cache)
        one = torch.cat([model(ids[:, p:p + 1], p, one_cache) for p in range(start, start + 9)], dim=1)
        many = model(ids[:, start:start + 9], start, many_cache)
        assert torch.equal(one, many)


def test_cli_drafter_dtype_applies_to_the_drafter_only(monkeypatch, capsys, random_models):
    seen = {}

    def recording_load(path, dtype, device):
        seen[Path(path).name] = dtype
        return load_model(path, dtype=dtype, device=device)
    monkeypatch.setattr("failfast.pipeline.load_model", recording_load)
    code = main(["generate", "--target", str(random_models["target"]), "--drafter", str(random_models["random-dllm"]),
                 "--policy", "fixed", "--k", "3", "--prompt-ids", "3,4", "--max-new-tokens", "4", "--json",
                 "--dtype", "float64", "--drafter-dtype", "float32"])
    assert code == 0 and json.loads(capsys.readouterr().out)["stats"]["tokens"] == 4
    assert seen == {random_models["target"].name: torch.float64, random_models["random-dllm"].name: torch.float32}
