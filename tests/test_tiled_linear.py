"""The tiled float32 kernel (model/tiled.py): F.linear's products up to float32 rounding, each
row's bits independent of how many rows share the call, float16 tiles exactly where the
weights are float16 values, PyTorch's product past MAX_ROWS rows, packed models using it,
and the switch that turns it off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from failfast import load_model
from failfast.model import tiled
from failfast.model.packed import pack_weight
from failfast.model.tiled import MAX_ROWS, TiledWeight, tile
from failfast.model.transformer import MLP, Attention, Linear, linear
from tests.helpers import tiny_config, write_model

AVX512 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512",
                            reason="the tiled kernel runs where PyTorch runs at AVX-512")


def operands(rows: int, out_features: int, in_features: int, bias: bool, float16_values: bool = True):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    if float16_values:
        w = w.half().float()
    b = torch.randn(out_features, generator=gen) if bias else None
    return torch.randn(rows, in_features, generator=gen), w, b


def reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@AVX512
def test_the_kernel_builds_on_an_avx512_cpu():
    assert tiled.kernel() is not None


@AVX512
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, MAX_ROWS])
@pytest.mark.parametrize("out_features, in_features", [(640, 384), (200, 100), (16, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_rows_match_float64_and_do_not_depend_on_the_row_count(rows, out_features, in_features, bias):
    x, w, b = operands(rows, out_features, in_features, bias)
    tiled_w = tile(w)
    assert tiled_w.tiles.dtype == torch.float16  # float16 values: half the bytes, widened exactly
    out = linear(x, tiled_w, b)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(x, w, b), rtol=1e-5, atol=1e-5)
    one_by_one = torch.cat([linear(x[i:i + 1], tiled_w, b) for i in range(rows)])
    assert torch.equal(out, one_by_one)


@AVX512
def test_float16_and_float32_tiles_of_the_same_values_give_the_same_bits():
    x, w, b = operands(9, 300, 128, bias=True)
    half = tile(w)
    wide = TiledWeight(half.tiles.float(), half.weight)
    assert torch.equal(linear(x, half, b), linear(x, wide, b))


@AVX512
def test_weights_that_are_not_float16_values_get_float32_tiles():
    x, w, b = operands(5, 96, 64, bias=False, float16_values=False)
    tiled_w = tile(w)
    assert tiled_w.tiles.dtype == torch.float32
    torch.testing.assert_close(linear(x, tiled_w, b).double(), reference(x, w, b), rtol=1e-5, atol=1e-5)


@AVX512
def test_more_rows_than_max_rows_take_pytorchs_product_and_any_layout_is_read_by_row():
    x, w, b = operands(MAX_ROWS + 1, 128, 64, bias=True)
    tiled_w = tile(w)
    assert torch.equal(linear(x, tiled_w, b), linear(x, w, b))
    batch = x[:12].view(3, 4, 64)
    strided = batch[:, 1:3]  # a batch slice: not contiguous
    assert torch.equal(linear(strided, tiled_w, b), linear(strided.contiguous(), tiled_w, b))
    assert torch.equal(linear(strided, tiled_w, b)[1, 0], linear(batch[1, 1], tiled_w, b))


@AVX512
def test_a_float32_model_multiplies_with_tiles(tmp_path):
    """Loaded in float32: every product has tiles (q/k/v and gate/up fused, the tied head a
    copy), and the model's logits match float64's."""
    folder = write_model(tmp_path / "m", tiny_config(tie_word_embeddings=True, attention_bias=True), seed=0)
    model = load_model(folder).model
    attention = next(m for m in model.modules() if isinstance(m, Attention))
    mlp = next(m for m in model.modules() if isinstance(m, MLP))
    assert isinstance(attention.qkv.keywords["weight"], TiledWeight) and attention.q_proj.packed is None
    assert isinstance(mlp.gate_up.keywords["weight"], TiledWeight) and isinstance(mlp.down_proj.packed, TiledWeight)
    assert isinstance(model.lm_head.packed, TiledWeight)
    wide = load_model(folder, dtype=torch.float64).model
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    caches = model.new_cache(16), wide.new_cache(16)
    for start, end in ((0, 5), (5, 6), (6, 9)):  # a prompt, one token, then several
        got, want = (m(ids[:, start:end], start, c) for m, c in zip((model, wide), caches))
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@AVX512
def test_a_layer_that_trains_again_multiplies_with_its_weight():
    layer = Linear(16, 8).requires_grad_(False)
    layer.packed = tile(layer.weight)
    with torch.no_grad():
        layer.weight.zero_()  # the tiles are stale now
    layer.requires_grad_(True)
    assert torch.equal(layer(torch.randn(3, 16)), layer.bias.expand(3, 8))


def test_the_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setenv(tiled.SWITCH, "0")
    tiled.kernel.cache_clear()
    try:
        w = torch.randn(64, 32)
        assert tile(w) is None
        packed = pack_weight(w)
        assert isinstance(packed, torch.Tensor) and packed.stride() == (1, 64)
    finally:
        monkeypatch.undo()
        tiled.kernel.cache_clear()
