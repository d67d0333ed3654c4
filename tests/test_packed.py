"""Prepacked weights (model/packed.py): bfloat16 rows independent of the batch, the same
products as `F.linear`, float32 weights column-major, parameters untouched, and never used
while a weight trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from failfast import load_model
from failfast.model.packed import pack_linears, pack_weight, packs_for_onednn
from failfast.model.precision import cpu_has_native_bf16
from failfast.model.tiled import TiledWeight
from failfast.model.config import ModelConfig
from failfast.model.transformer import MLP, Attention, Linear, Transformer, linear
from tests.helpers import random_model, tiny_config, write_model

PACKS = pytest.mark.skipif(not packs_for_onednn(torch.zeros(1, dtype=torch.bfloat16)),
                           reason="needs a PyTorch whose oneDNN runs bfloat16 on this CPU")
# oneDNN emulates bfloat16 on an AVX-512 CPU without AVX512-BF16, and there no bf16 product's
# rows are independent of the batch (packed or not); where it is native they are.
ROW_INVARIANT = pytest.mark.skipif(not cpu_has_native_bf16(), reason="needs a CPU with native bfloat16")


@PACKS
@ROW_INVARIANT
@pytest.mark.parametrize("rows", [1, 2, 9, 32, 33, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_rows_do_not_depend_on_the_batch_and_match_f_linear(rows, bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 384, generator=gen).bfloat16()
    w = torch.randn(1024, 384, generator=gen).bfloat16()
    b = torch.randn(1024, generator=gen).bfloat16() if bias else None
    packed = pack_weight(w)
    assert packed.is_mkldnn
    out = linear(x, packed, b)
    one_by_one = torch.cat([linear(x[i:i + 1], packed, b) for i in range(rows)])
    assert torch.equal(out, one_by_one)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-2, atol=1e-2)


@PACKS
def test_pack_linears_keeps_parameters_and_ties(tmp_path):
    loaded = load_model(write_model(tmp_path / "tied", tiny_config(tie_word_embeddings=True), seed=0),
                        dtype=torch.bfloat16)
    model = loaded.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert layers and all(m.packed is not None and m.packed.is_mkldnn for m in layers)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
    assert not any(t.is_mkldnn for t in model.state_dict().values())


def test_nothing_is_packed_in_float64_or_while_training():
    cfg = tiny_config()
    model = random_model(cfg, seed=0)
    assert pack_linears(model.requires_grad_(True)) == 0  # a training model
    assert pack_linears(model.bfloat16().requires_grad_(True)) == 0
    assert pack_linears(model.double().requires_grad_(False)) == 0
    assert pack_linears(random_model(cfg, seed=0).float().requires_grad_(True)) == 0


def test_converting_a_packed_model_drops_its_packed_and_fused_copies(tmp_path):
    """`.double()` after a float32 load computes what `.double()` of an unpacked load does."""
    folder = write_model(tmp_path / "tied", tiny_config(tie_word_embeddings=True, attention_bias=True), seed=0)
    converted, fresh = load_model(folder).model.double(), load_model(folder, pack=False).model.double()
    assert converted.lm_head.packed is None
    assert all(m.qkv is None for m in converted.modules() if isinstance(m, Attention))
    assert all(m.gate_up is None for m in converted.modules() if isinstance(m, MLP))
    ids = torch.randint(0, converted.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    # equal up to float64 rounding (the converted weights keep their column-major layout)
    torch.testing.assert_close(converted(ids, 0, converted.new_cache(16)), fresh(ids, 0, fresh.new_cache(16)),
                               rtol=1e-12, atol=1e-12)


def laid_out(packed: torch.Tensor | TiledWeight) -> torch.Tensor:
    """A packed float32 weight's column-major tensor (beside its tiles where the tiled kernel runs)."""
    return packed.weight if isinstance(packed, TiledWeight) else packed


@pytest.mark.parametrize("rows", [1, 4, 16, 33, 70])
def test_float32_weights_are_packed_column_major_with_the_same_values(rows):
    gen = torch.Generator().manual_seed(rows)
    w, b = torch.randn(1024, 384, generator=gen), torch.randn(1024, generator=gen)
    packed = laid_out(pack_weight(w))
    assert packed.shape == w.shape and packed.stride() == (1, 1024) and torch.equal(packed, w)
    x = torch.randn(rows, 384, generator=gen)
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_a_float32_head_tied_to_the_embedding_gets_a_column_major_copy(tmp_path):
    model = load_model(write_model(tmp_path / "tied", tiny_config(tie_word_embeddings=True), seed=0)).model
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.lm_head.weight.is_contiguous()
    assert laid_out(model.lm_head.packed).stride() == (1, model.config.vocab_size)
    assert torch.equal(laid_out(model.lm_head.packed), model.lm_head.weight)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct storages behind a model's parameters."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}.values())


def twin_models(dtype: torch.dtype, **options) -> tuple[ModelConfig, Transformer, Transformer]:
    """A small random model's config and two identical inference copies of it in `dtype`."""
    cfg = tiny_config(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, **options)
    return cfg, *(random_model(cfg, seed=5).to(dtype).requires_grad_(False) for _ in range(2))


def logits_step_by_step(plain: Transformer, packed: Transformer):
    """(start, end, plain's logits, packed's logits) for a prompt, one token, then several."""
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    caches = plain.new_cache(64), packed.new_cache(64)
    for start, end in ((0, 30), (30, 31), (31, 40)):
        yield start, end, *(model(ids[:, start:end], start, cache) for model, cache in zip((plain, packed), caches))


def test_a_float32_model_is_packed_and_computes_what_the_unpacked_one_does():
    cfg, plain, packed = twin_models(torch.float32, attention_bias=True)
    layers = sum(isinstance(m, Linear) for m in packed.modules())
    bytes_before = parameter_bytes(packed)
    assert pack_linears(packed) == layers
    assert all(m.qkv is not None for m in packed.modules() if isinstance(m, Attention))
    assert all(m.gate_up is not None for m in packed.modules() if isinstance(m, MLP))
    # the same values and shapes, column-major, and no second copy: q/k/v share the fused weight
    for (name, want), got in zip(plain.state_dict().items(), packed.state_dict().values()):
        assert torch.equal(got, want), name
    attention = next(m for m in packed.modules() if isinstance(m, Attention))
    fused = laid_out(attention.qkv.weight).untyped_storage().data_ptr()
    assert attention.q_proj.weight.untyped_storage().data_ptr() == fused
    assert attention.v_proj.weight.untyped_storage().data_ptr() == fused
    assert packed.model.layers[0].mlp.down_proj.weight.stride() == (1, cfg.hidden_size)
    assert parameter_bytes(packed) <= bytes_before
    for _, _, want, got in logits_step_by_step(plain, packed):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@PACKS
def test_a_packed_layer_whose_weight_trains_again_uses_the_weight():
    layer = Linear(16, 8).bfloat16().requires_grad_(False)
    assert pack_linears(layer) == 1
    with torch.no_grad():
        layer.weight.zero_()  # the packed copy is stale now
    layer.requires_grad_(True)
    x = torch.randn(3, 16).bfloat16()
    out = layer(x)
    assert torch.equal(out, layer.bias.expand(3, 8))
    out.float().sum().backward()
    assert layer.weight.grad is not None


@PACKS
@pytest.mark.parametrize("qk_norm, bias", [(False, True), (True, False)])
def test_a_packed_model_computes_what_the_unpacked_one_does(qk_norm, bias):
    """Fused q/k/v and gate/up products (Qwen2 with biases, Qwen3 with q/k norms): the same
    logits as separate unpacked layers, for one token and for several."""
    _, plain, packed = twin_models(torch.bfloat16, qk_norm=qk_norm, attention_bias=bias)
    pack_linears(packed)
    assert all(m.qkv is not None for m in packed.modules() if isinstance(m, Attention))
    assert all(m.gate_up is not None for m in packed.modules() if isinstance(m, MLP))
    for start, end, want, got in logits_step_by_step(plain, packed):
        assert torch.equal(want, got), (start, end)
