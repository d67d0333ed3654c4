"""The default dtype (bfloat16 on CUDA and on AVX512-BF16 CPUs without AMX, float32 elsewhere;
--dtype wins) and 16-bit inference whose verification forwards round like one-token decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from failfast import GenerationInputError, load_model, make_drafter
from failfast.cli import main
from failfast.model import precision
from failfast.model.packed import pack_linears
from failfast.model.precision import default_dtype, resolve_dtype
from failfast.model import transformer
from failfast.model.transformer import attention_mask, batch_invariant_attention, key_blocked_product, linear
from tests.helpers import random_model, tiny_config


@pytest.mark.parametrize("avx512_bf16, amx, expected", [(False, False, torch.float32), (True, False, torch.bfloat16),
                                                      (True, True, torch.float32), (False, True, torch.float32)])
def test_cpu_inference_defaults_to_bfloat16_only_where_it_measured_fastest(monkeypatch, avx512_bf16, amx, expected):
    """AVX512-BF16 without AMX: bfloat16; AMX (one-token decoding measured slower in bf16) and
    CPUs without native bf16: float32. Native bf16 is detected either way (training uses it)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert precision.cpu_has_native_bf16() == (avx512_bf16 or amx) == precision.has_native_bf16("cpu")
    assert default_dtype("cpu") == expected and resolve_dtype("auto") == resolve_dtype(None) == expected
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("float64") == torch.float64  # explicit wins


@pytest.mark.parametrize("bf16_supported, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_cuda_inference_defaults_to_bfloat16_where_supported(monkeypatch, bf16_supported, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
    assert default_dtype("cuda") == expected and resolve_dtype("auto", "cuda") == expected


def test_unknown_dtype_is_a_clear_error():
    with pytest.raises(GenerationInputError, match="unknown dtype 'fp7'"):
        resolve_dtype("fp7")


@pytest.mark.parametrize("prefers_bf16, flag, expected", [(False, [], "float32"), (True, [], "bfloat16"),
                                                          (True, ["--dtype", "float32"], "float32"),
                                                          (False, ["--dtype", "bfloat16"], "bfloat16")])
def test_cli_dtype_follows_the_hardware_unless_given(monkeypatch, capsys, target_dir, prefers_bf16, flag, expected):
    monkeypatch.setattr(precision, "cpu_prefers_bf16", lambda: prefers_bf16)
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


def test_row_blocked_16_bit_ops_split_rows_and_keys_and_compute_the_same(monkeypatch):
    """16-bit linears and attention products see at most ROW_BLOCK rows per call and sum fixed
    KEY_BLOCK key ranges, and still compute F.linear and weights @ v (against float64)."""
    monkeypatch.setattr(transformer, "KEY_BLOCK", 16)
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 30, 24, generator=gen), torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    rows_seen = []
    real_linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, *rest: rows_seen.append(a.shape[:-1].numel()) or real_linear(a, *rest))
    out = linear(x.bfloat16(), w.bfloat16(), b.bfloat16())
    assert rows_seen == [32, 32, 26] and out.shape == (3, 30, 40) and out.dtype == torch.bfloat16
    expected = x.bfloat16().double() @ w.bfloat16().double().T + b.bfloat16().double()
    assert torch.allclose(out.double(), expected, rtol=2e-2, atol=5e-2)
    rows_seen.clear()
    assert torch.equal(linear(x.double(), w.double()), x.double() @ w.double().T) and rows_seen == [90]  # one call
    rows_seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # training: whole calls (exactness is for inference)
        linear(x.bfloat16(), w.bfloat16())
    assert rows_seen == [90]
    weights, v = torch.rand(2, 40, 50, generator=gen).bfloat16(), torch.randn(2, 50, 8, generator=gen).bfloat16()
    assert torch.allclose(key_blocked_product(weights, v).double(), weights.double() @ v.double(), rtol=2e-2, atol=5e-2)


NATIVE_BF16 = pytest.mark.skipif(not precision.cpu_has_native_bf16(), reason="needs a CPU with native bf16")
BF16_DEFAULT = pytest.mark.skipif(not precision.cpu_prefers_bf16(), reason="bf16 is the default only on "
                                  "AVX512-BF16 CPUs without AMX; long 16-bit forwards are checked there")


@pytest.mark.parametrize("starts, width", [pytest.param((1, 17, 64, 100), 9, marks=NATIVE_BF16),
                                           pytest.param((5, 300), 33, marks=BF16_DEFAULT),
                                           pytest.param((40,), 64, marks=BF16_DEFAULT),
                                           pytest.param((1000, 1020), 33, marks=BF16_DEFAULT)])
@pytest.mark.parametrize("packed", [False, True])
def test_bf16_verification_rounds_like_one_token_decoding(starts, width, packed):
    """In bfloat16 a k-token forward gives bit-identical logits to k one-token forwards: short
    verifications on any native-bf16 CPU; where bf16 is the default also long ones (more rows
    than one kernel block) and contexts whose key range crosses 1,024 during the forward.
    The layer shapes are the embedded target's; with and without prepacked weights (what
    `load_model` gives in bfloat16 on a CPU)."""
    cfg = tiny_config(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_attention_heads=6,
                      num_key_value_heads=2, max_position_embeddings=1100)
    model = random_model(cfg, seed=3).to(torch.bfloat16).requires_grad_(False)
    if packed:
        assert pack_linears(model) == cfg.num_hidden_layers * 7 + 1
    ids = torch.randint(0, 8192, (1, 1100), generator=torch.Generator().manual_seed(0))
    for start in starts:
        one_cache, many_cache = model.new_cache(1100), model.new_cache(1100)
        model(ids[:, :start], 0, one_cache)
        model(ids[:, :start], 0, many_cache)
        one = torch.cat([model(ids[:, p:p + 1], p, one_cache) for p in range(start, start + width)], dim=1)
        many = model(ids[:, start:start + width], start, many_cache)
        assert torch.equal(one, many), f"start {start}, {width} tokens"


def test_cli_drafter_dtype_applies_to_the_drafter_only(monkeypatch, capsys, random_models):
    seen = {}

    def recording_load(path, dtype, device, int8=None):
        seen[Path(path).name] = dtype
        return load_model(path, dtype=dtype, device=device)
    monkeypatch.setattr("failfast.pipeline.load_model", recording_load)
    monkeypatch.setattr("failfast.pipeline.load_drafter", recording_load)
    code = main(["generate", "--target", str(random_models["target"]), "--drafter", str(random_models["random-dllm"]),
                 "--policy", "fixed", "--k", "3", "--prompt-ids", "3,4", "--max-new-tokens", "4", "--json",
                 "--dtype", "float64", "--drafter-dtype", "float32"])
    assert code == 0 and json.loads(capsys.readouterr().out)["stats"]["tokens"] == 4
    assert seen == {random_models["target"].name: torch.float64, random_models["random-dllm"].name: torch.float32}


def test_drafters_take_fast_attention_and_a_model_that_also_verifies_does_not(random_models):
    """A drafter's own model runs SDPA in 16 bits (its rounding never reaches the output); the
    target, and a drafter that is the target's very model, keep batch-invariant attention."""
    target = load_model(random_models["target"], dtype=torch.bfloat16)
    exact = lambda loaded: {m.batch_invariant for m in loaded.model.modules()  # noqa: E731
                            if isinstance(m, transformer.Attention)}
    for name in ("random-dllm", "random-ar"):
        drafter = load_model(random_models[name], dtype=torch.bfloat16)
        make_drafter(target, drafter)
        assert exact(drafter) == {False} and exact(target) == {True}
    make_drafter(target, target)
    assert exact(target) == {True}
