"""Float32 CPU kernels (model/cpu_kernels.py): the tiled product (model/tiled.py), RMSNorm and
attention compute PyTorch's results up to float32 rounding, RoPE its bits; each row's bits
do not depend on how many rows share the call; float16 tiles exactly where the weights are
float16 values, PyTorch's product past MAX_ROWS rows, float32 models using the kernels (a
k-token forward equal to k one-token forwards), and the switch that turns them off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from failfast import load_model
from failfast.model import cpu_kernels
from failfast.model.packed import pack_weight
from failfast.model.ragged import Ragged
from failfast.model.tiled import MAX_ROWS, TiledWeight, tile
from failfast.model.transformer import MLP, Attention, Linear, RMSNorm, Rotary, apply_rotary, linear
from tests.helpers import tiny_config, write_model

AVX512 = pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() != "AVX512" or not cpu_kernels.toolchain(),
                            reason="the kernels run where PyTorch runs at AVX-512 and a C++ compiler builds them")


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
def test_the_kernels_build_on_an_avx512_cpu():
    assert cpu_kernels.kernels() is not None


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


@AVX512
@pytest.mark.parametrize("shape", [(1, 1, 384), (2, 7, 256), (1, 5, 6, 64), (3, 40)])
def test_rms_norm_matches_float64_and_does_not_depend_on_the_row_count(shape):
    gen = torch.Generator().manual_seed(len(shape))
    norm = RMSNorm(shape[-1], 1e-6).requires_grad_(False)
    norm.weight.copy_(torch.randn(shape[-1], generator=gen))
    x = torch.randn(shape, generator=gen) * 3
    out = norm(x)
    want = F.rms_norm(x.double(), (shape[-1],), norm.weight.double(), 1e-6)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    rows = x.reshape(-1, shape[-1])
    assert torch.equal(out.reshape(-1, shape[-1]), torch.cat([norm(rows[i:i + 1]) for i in range(rows.shape[0])]))
    assert torch.equal(norm(x.transpose(0, -2)), out.transpose(0, -2))  # strided input


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    cpu_kernels.kernels.cache_clear()
    try:
        w = torch.randn(64, 32)
        assert tile(w) is None and cpu_kernels.runs_on(w) is None
        packed = pack_weight(w)
        assert isinstance(packed, torch.Tensor) and packed.stride() == (1, 64)
    finally:
        monkeypatch.undo()
        cpu_kernels.kernels.cache_clear()


def sdpa_reference(q, k, v, mask):
    """float64 SDPA of [B, H, T, D] queries, as [B, T, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    m = None if mask is None else mask[:, None]
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=m).transpose(1, 2)


@AVX512
@pytest.mark.parametrize("head_dim", [8, 64, 100, 128])
@pytest.mark.parametrize("queries, keys", [(1, 1), (1, 37), (5, 300), (16, 40)])
def test_attention_matches_float64_and_a_query_does_not_depend_on_the_others(head_dim, queries, keys):
    """Causal queries at the end of `keys` cached positions, 6 heads over 2 key/value heads, read
    from a larger cache (strided): each query alone, with only its keys, gives the same bits."""
    gen = torch.Generator().manual_seed(head_dim + queries + keys)
    cache_k, cache_v = (torch.randn(2, 2, keys + 9, head_dim, generator=gen) for _ in range(2))
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]
    q = torch.randn(2, queries, 6, head_dim, generator=gen).transpose(1, 2)
    positions = torch.arange(keys - queries, keys)
    mask = (torch.arange(keys) <= positions[:, None]).expand(2, queries, keys)
    out = cpu_kernels.kernels().attend(q, k, v, mask, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), sdpa_reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
    for i in range(queries):
        end = keys - queries + i + 1
        alone = cpu_kernels.kernels().attend(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], None, head_dim ** -0.5)
        assert torch.equal(alone[:, 0], out[:, i])


@AVX512
def test_attention_masks_keys_exactly_and_a_query_with_none_gets_zeros():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (3, 40, 40))
    v[:, :, 20:] = float("nan")  # masked keys' values never reach the result
    mask = torch.zeros(1, 3, 40, dtype=torch.bool)
    mask[0, 0, :20] = True
    mask[0, 1, 5:17:3] = True  # not a prefix
    out = cpu_kernels.kernels().attend(q, k, v, mask, 0.25)
    want = sdpa_reference(q[:, :, :2], k[:, :, :20], v[:, :, :20], mask[:, :2, :20])
    want[0, 0] = sdpa_reference(q[:, :, :1], k[:, :, :20], v[:, :, :20], None)[0, 0]
    torch.testing.assert_close(out[:, :2].double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[:, 2], torch.zeros_like(out[:, 2]))


@AVX512
def test_a_float32_verification_forward_computes_what_one_token_forwards_do(tmp_path):
    """The point of the kernels: k tokens in one forward give bit for bit the logits of k
    one-token forwards (lossless float32 verification by construction), alone and in a batch."""
    cfg = tiny_config(vocab_size=300, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, attention_bias=True)
    model = load_model(write_model(tmp_path / "m", cfg, seed=3)).model
    ids = torch.randint(0, 300, (1, 60), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(64)
    with torch.inference_mode():
        model(ids[:, :40], 0, cache)
        verified = model(ids[:, 40:52], 40, cache)
        cache.length = 40
        one_by_one = torch.cat([model(ids[:, p:p + 1], p, cache) for p in range(40, 52)], dim=1)
        batch = model.new_cache(64, batch=2)  # beside another row with another context
        model(ids[:, :40], 0, batch.row(0))
        model(ids[:, 5:35], 0, batch.row(1))
        ragged = Ragged.pack([0, 1], [40, 30], [ids[0, 40:52].tolist(), ids[0, 35:40].tolist()], model.device)
        in_batch = model.forward_ragged(ragged, batch)[:12]
    assert torch.equal(verified, one_by_one)
    assert torch.equal(in_batch, one_by_one[0])


@AVX512
@pytest.mark.parametrize("head_dim", [8, 64, 100])
def test_rotary_gives_the_bits_of_the_formula_for_strided_heads(head_dim):
    rope = Rotary(head_dim, 10000.0)(torch.arange(295, 300), torch.float32)
    x = torch.randn(2, 5, 3, head_dim, generator=torch.Generator().manual_seed(head_dim)).transpose(1, 2)
    out = cpu_kernels.kernels().rotary(x, *rope)
    assert out.is_contiguous() and torch.equal(out, x * rope[0] + x.roll(head_dim // 2, dims=-1) * rope[1])
    assert torch.equal(apply_rotary(x, *rope), out)
