"""Float32 CPU kernels (model/cpu_kernels.py): the tiled product (model/tiled.py), RMSNorm and
attention compute PyTorch's results up to float32 rounding, RoPE its bits; each row's bits
do not depend on how many rows share the call; float16 tiles exactly where the weights are
float16 values, PyTorch's product past MAX_ROWS rows, float32 models using the kernels (a
k-token forward equal to k one-token forwards), and the switch that turns them off."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from failfast import load_model
from failfast.model import cpu_kernels
from failfast.model.int8 import load_drafter
from failfast.model.packed import pack_weight
from failfast.model.ragged import Ragged
from failfast.model.tiled import MAX_ROWS, TiledWeight, tile
from failfast.model.transformer import MLP, Attention, Linear, RMSNorm, Rotary, Transformer, apply_rotary, linear
from failfast.model.dflash import DFlashModel
from failfast.model.eagle3 import Eagle3Model
from tests.helpers import tiny_config, tiny_dflash_config, tiny_eagle3_config, write_model

AVX512 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512" or not cpu_kernels.toolchain()
    or os.environ.get(cpu_kernels.SWITCH) == "0",
    reason="the kernels run where PyTorch runs at AVX-512, a C++ compiler builds them and they are not switched off")


def operands(rows: int, out_features: int, in_features: int, bias: bool, float16_values: bool = True):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    if float16_values:
        w = w.half().float()
    b = torch.randn(out_features, generator=gen) if bias else None
    return torch.randn(rows, in_features, generator=gen), w, b


def attached_drafter(tmp_path, drafter_config):
    """(target config, float32 target, a drafter of `drafter_config(target config)` reading
    it, with the target's embedding and head attached)."""
    target_cfg = tiny_config(vocab_size=120, intermediate_size=96)
    target = load_model(write_model(tmp_path / "t", target_cfg, seed=0)).model
    drafter = load_model(write_model(tmp_path / "d", drafter_config(target_cfg), seed=1)).model
    drafter.attach(target.model.embed_tokens, target.lm_head)
    return target_cfg, target, drafter


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
def test_more_rows_than_max_rows_or_gradients_take_pytorchs_product_and_any_layout_is_read_by_row():
    x, w, b = operands(MAX_ROWS + 1, 128, 64, bias=True)
    zeros = TiledWeight(torch.zeros_like(tile(w).tiles), w)  # tiles unlike the weight: which path ran shows
    assert torch.equal(linear(x[:MAX_ROWS], zeros, b), b.expand(MAX_ROWS, 128))
    assert torch.equal(linear(x, zeros, b), linear(x, w, b))
    wanting = x[:3].clone().requires_grad_(True)
    out = linear(wanting, zeros, b)
    assert out.grad_fn is not None and torch.equal(out, F.linear(wanting, w, b))
    tiled_w = tile(w)
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
    assert isinstance(attention.qkv.weight, TiledWeight) and attention.q_proj.packed is None
    assert isinstance(mlp.gate_up.weight, TiledWeight) and isinstance(mlp.down_proj.packed, TiledWeight)
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
    layer.pack(tile(layer.weight))
    assert torch.equal(layer(torch.ones(1, 16)), layer.packed.product(torch.ones(1, 16), layer.bias))
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


@AVX512
def test_swiglu_matches_float64_whatever_the_rows_and_threads():
    """PyTorch's SiLU takes a scalar exp for a chunk's leftovers, so its bits moved with the row
    count and thread split; the kernel's do not."""
    gen = torch.Generator().manual_seed(4)
    gate_up = torch.randn(40, 2 * 2000, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 4):
            torch.set_num_threads(n)
            outs.append(cpu_kernels.kernels().swiglu(gate, up))
            outs.append(torch.cat([cpu_kernels.kernels().swiglu(gate[i:i + 1], up[i:i + 1]) for i in range(40)]))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], other) for other in outs[1:])
    torch.testing.assert_close(outs[0].double(), F.silu(gate.double()) * up.double(), rtol=1e-6, atol=1e-6)


@AVX512
def test_a_wide_mlp_verifies_like_one_token_forwards_on_more_threads(tmp_path):
    """Qwen2.5-0.5B's MLP width (4864) on 4 threads, where PyTorch's SiLU broke the equality."""
    cfg = tiny_config(vocab_size=200, hidden_size=64, intermediate_size=4864, num_attention_heads=2,
                      num_key_value_heads=1, attention_bias=True)
    model = load_model(write_model(tmp_path / "m", cfg, seed=1)).model
    ids = torch.randint(0, 200, (1, 40), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with torch.inference_mode():
            cache = model.new_cache(48)
            model(ids[:, :20], 0, cache)
            verified = model(ids[:, 20:40], 20, cache)
            cache.length = 20
            one_by_one = torch.cat([model(ids[:, p:p + 1], p, cache) for p in range(20, 40)], dim=1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(verified, one_by_one)


@AVX512
def test_a_packed_model_whose_weights_change_in_place_stops_using_its_copies(tmp_path):
    """`load_state_dict` into a loaded float32 model: its tiles and fused products are stale,
    so it computes with the new weights (as a fresh load of them does)."""
    cfg = tiny_config(tie_word_embeddings=True, attention_bias=True)
    model = load_model(write_model(tmp_path / "a", cfg, seed=0)).model
    other = load_model(write_model(tmp_path / "b", cfg, seed=1), dtype=torch.float64).model
    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    model(ids, 0, model.new_cache(16))  # the one-call layers' weights are read (and kept) here
    model.load_state_dict({k: v.float() for k, v in other.state_dict().items()})
    got, want = (m(ids, 0, m.new_cache(16)) for m in (model, other))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@AVX512
def test_heads_wider_than_the_attention_kernel_take_sdpa(tmp_path):
    cfg = tiny_config(hidden_size=288, num_attention_heads=2, num_key_value_heads=1, head_dim=144)
    model = load_model(write_model(tmp_path / "m", cfg, seed=0)).model
    wide = load_model(tmp_path / "m", dtype=torch.float64).model
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    got, want = (m(ids, 0, m.new_cache(8)) for m in (model, wide))
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


def op_by_op(monkeypatch, run):
    """`run()` with every layer computed op by op (no one-call kernel layers)."""
    with monkeypatch.context() as patch:
        patch.setattr(Transformer, "_kernel_layers", lambda *args: None)
        return run()


@AVX512
@pytest.mark.parametrize("overrides", [
    dict(attention_bias=True),  # Qwen2: q/k/v biases
    dict(model_type="qwen3", qk_norm=True, attention_bias=False),  # per-head q/k RMSNorm
    dict(hidden_size=200, num_attention_heads=2, num_key_value_heads=2, head_dim=100),  # heads of 6.25 vectors
    dict(block_size=8, mask_token_id=95),  # a block-diffusion drafter's passes
])
def test_one_call_layers_compute_the_bits_of_the_op_by_op_layers(tmp_path, monkeypatch, overrides):
    """docs/design.md, "One call per layer": logits and every cached K/V bit-equal to the layers'
    op-by-op forward, for a prompt, a verification, one token, two rows, and scratch passes
    that read K/V written past them."""
    cfg = tiny_config(vocab_size=120, intermediate_size=96, **overrides)
    model = load_model(write_model(tmp_path / "m", cfg, seed=2)).model
    block = cfg.block_size
    ids = torch.randint(0, 120, (2, 60), generator=torch.Generator().manual_seed(5))

    def forwards():
        cache = model.new_cache(72, batch=2)
        out = [model(ids[:, :40], 0, cache, block_size=block), model(ids[:, 40:45], 40, cache),
               model(ids[:, 45:46], 45, cache),
               model(ids[:, 46:50], 46, cache, commit=False, context_end=block and 56, block_size=block),
               model(ids[:, 50:53], 50 if block else 46, cache, commit=False, context_end=block and 56,
                     block_size=block)]
        return out + cache.keys + cache.values

    assert model._kernel_layers(1, model.new_cache(8)) is not None
    with torch.inference_mode():
        fused, reference_ = forwards(), op_by_op(monkeypatch, forwards)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference_, strict=True))


@AVX512
@pytest.mark.parametrize("block", [None, 8])
def test_packed_one_call_layers_compute_the_bits_of_the_op_by_op_layers(tmp_path, monkeypatch, block):
    """A ragged forward of three cache rows of a four-row cache (a batch's verification, with
    bucketed filler tokens in the last row; or a block drafter's scratch passes reading up to
    each row's context end): logits and every cached K/V as op by op."""
    cfg = tiny_config(vocab_size=120, intermediate_size=96, model_type="qwen3", qk_norm=True,
                      **({} if block is None else dict(block_size=block, mask_token_id=95)))
    model = load_model(write_model(tmp_path / "m", cfg, seed=4)).model
    ids = torch.randint(0, 120, (3, 40), generator=torch.Generator().manual_seed(6))

    def forwards():
        cache = model.new_cache(48, batch=4)
        for row, length in enumerate((16, 24, 8)):
            model(ids[row:row + 1, :length], 0, cache.row(row), block_size=block)
        rows = [(0, 16, ids[0, 16:21]), (2, 8, ids[2, 8:9]), (1, 24, ids[1, 24:31])]
        if block is None:
            ragged = Ragged.pack(*zip(*[(r, s, t.tolist()) for r, s, t in rows]), model.device, padding_row=3,
                                 capacity=48)
            out = model.forward_ragged(ragged, cache)
        else:
            ragged = Ragged.pack(*zip(*[(r, s, t.tolist()) for r, s, t in rows]), model.device)
            out = model.forward_ragged(ragged, cache, block_size=block, context_ends=[22, 12, 31])
        return [out, *cache.keys, *cache.values]

    with torch.inference_mode():
        fused, reference_ = forwards(), op_by_op(monkeypatch, forwards)
    assert all(torch.equal(a, b) for a, b in zip(fused, reference_, strict=True))


@AVX512
def test_layers_run_op_by_op_past_max_rows_with_int8_weights_and_while_a_weight_trains(tmp_path):
    folder = write_model(tmp_path / "m", tiny_config(), seed=0)
    int8 = load_drafter(folder, torch.float32, int8=True).model
    assert all(layer.kernel_weights() is None for layer in int8.model.layers)
    assert int8(torch.tensor([[3, 4]]), 0, int8.new_cache(4)).shape == (1, 2, 96)
    model = load_model(folder).model
    cache = model.new_cache(8)
    assert model._kernel_layers(MAX_ROWS, cache) is not None
    assert model._kernel_layers(MAX_ROWS + 1, cache) is None
    model.model.layers[1].post_attention_layernorm.weight.requires_grad_(True)
    assert model.model.layers[0].kernel_weights() is not None and model.model.layers[1].kernel_weights() is None
    assert model._kernel_layers(1, cache) is None
    model.model.layers[1].post_attention_layernorm.weight.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)  # the kernels have no backward: op by op
    assert model._kernel_layers(1, cache) is None
    assert model(torch.tensor([[3, 4]]), 0, model.new_cache(4)).requires_grad
    with pytest.raises(RuntimeError, match="come together"):  # a checked error, not a crash
        w = load_model(folder).model.model.layers[0].kernel_weights()
        cpu_kernels.kernels().packed_decoder_layer(
            torch.zeros(1, 1, 32), *w[:-1], *Rotary(8, 1e4).rows(torch.tensor([0]), torch.float32),
            *model.new_cache(4).keys[:1], *model.new_cache(4).values[:1], torch.tensor([[0], [0], [1]]), 4, 1.0,
            embedded_norm=w.input_norm)


@AVX512
def test_a_parameter_replaced_after_a_forward_is_what_the_next_forward_reads(tmp_path, monkeypatch):
    """Kept kernel weights go stale when a module gets a new parameter object (no version moves)."""
    model = load_model(write_model(tmp_path / "m", tiny_config(), seed=0)).model
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(ids, 0, model.new_cache(8))
    model.model.layers[0].input_layernorm.weight = torch.nn.Parameter(torch.full((32,), 3.0), requires_grad=False)
    with torch.inference_mode():
        fused, reference_ = (run() for run in (lambda: model(ids, 0, model.new_cache(8)),
                                              lambda: op_by_op(monkeypatch, lambda: model(ids, 0, model.new_cache(8)))))
    assert torch.equal(fused, reference_)


@AVX512
def test_an_eagle3_step_in_one_call_computes_the_op_by_op_step(tmp_path, monkeypatch):
    """Three rows at different positions of a drafter cache: outputs and written K/V as the
    op-by-op step's up to float32 rounding (its attention is SDPA there, the kernel here)."""
    target_cfg, target, drafter = attached_drafter(tmp_path, tiny_eagle3_config)
    assert drafter.midlayer.kernel_weights() is not None
    gen = torch.Generator().manual_seed(3)
    context = torch.randn(3, 8, target_cfg.hidden_size, generator=gen)
    tokens, hidden = torch.randint(0, 120, (3, 9), generator=gen), torch.randn(3, 1, target_cfg.hidden_size, generator=gen)

    def step():
        cache = drafter.new_cache(16, batch=3)
        for row, length in enumerate((5, 3, 7)):
            drafter.write_context(tokens[row:row + 1, :length], context[row:row + 1, :length], 0, cache.row(row))
        out = drafter.step_rows(tokens[[0, 2, 1], 8:9], hidden, [0, 2, 1], [5, 7, 3], cache)
        return [out, *cache.keys, *cache.values]

    with torch.inference_mode():
        fused = step()
        with monkeypatch.context() as patch:
            patch.setattr(Eagle3Model, "_kernel_weights", lambda *args: None)
            reference_ = step()
    for a, b in zip(fused, reference_, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@AVX512
def test_dflash_passes_in_one_call_compute_the_op_by_op_passes(tmp_path, monkeypatch):
    """Context writes in one call (`context_kv`) and blocks of three rows of a drafter cache
    (different contexts and widths) in one packed call: context K/V and hidden states as the
    op-by-op ones up to float32 rounding (separate k/v products and SDPA there), each row's
    pass bit-equal to its pass alone, and the cached context untouched by the passes."""
    target_cfg, target, drafter = attached_drafter(tmp_path, lambda cfg: tiny_dflash_config(cfg, num_hidden_layers=2))
    assert all(layer.kernel_weights() is not None for layer in drafter.layers)
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(3, 9, 2 * target_cfg.hidden_size, generator=gen)
    windows = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (4, 7, 5)]
    rows, lengths = [0, 2, 1], [5, 9, 3]

    def passes():
        cache = drafter.new_cache(24, batch=3)
        views = [cache.row(row) for row in range(3)]
        for row, length in enumerate(lengths):
            drafter.write_context(features[row:row + 1, :length], 0, views[row])
        context = [t.clone() for t in cache.keys + cache.values]
        out = drafter.draft_passes(windows, rows, [lengths[r] for r in rows], cache)
        alone = [drafter.draft_pass(torch.tensor([w]), lengths[r], views[r])[0] for w, r in zip(windows, rows)]
        assert [view.length for view in views] == lengths
        kept = all(torch.equal(a[r, :, :n], b[r, :, :n]) for a, b in zip(context, cache.keys + cache.values)
                   for r, n in enumerate(lengths))
        return out, alone, kept, [t[r, :, :n] for t in context for r, n in enumerate(lengths)]

    with torch.inference_mode():
        fused, alone, kept, context = passes()
        with monkeypatch.context() as patch:
            patch.setattr(DFlashModel, "_kernel_weights", lambda *args: None)
            reference_, _, _, reference_context = passes()
    assert kept
    assert all(torch.equal(a, b) for a, b in zip(fused, alone, strict=True))
    for a, b in zip(fused + context, reference_ + reference_context, strict=True):  # passes, then context K/V
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@AVX512
def test_a_whole_forward_in_one_call_computes_the_bits_of_one_call_per_layer(tmp_path, monkeypatch):
    """docs/design.md, "One call per forward": logits (all, none, chosen, repeated and negative indices,
    through a reduced head), tapped layers' outputs and every cached K/V bit-equal to one kernel
    call per layer, for a cache's rows (causal and block-diffusion scratch passes) and for
    packed forwards (bucketed, and block passes with context ends)."""
    cfg = tiny_config(vocab_size=120, intermediate_size=96, model_type="qwen3", qk_norm=True, num_hidden_layers=3,
                      block_size=8, mask_token_id=119)
    model = load_model(write_model(tmp_path / "m", cfg, seed=7)).model
    ids = torch.randint(0, 120, (2, 40), generator=torch.Generator().manual_seed(8))
    reduced = pack_weight(model.lm_head.weight.detach()[[5, 9, 30, 77]].contiguous())
    assert isinstance(reduced, TiledWeight)

    def forwards():
        cache = model.new_cache(48, batch=2)
        out = [model(ids[:, :20], 0, cache, logits_at=slice(0, 0)), *model(ids[:, 20:25], 20, cache, taps=(0, 2)),
               model(ids[:, 25:28], 25, cache, logits_at=[2, 0, -1]), model(ids[:, 28:29], 28, cache),
               model(ids[:, 29:32], 29, cache, logits_at=[0, 2], head_weight=reduced),
               model(ids[:, 32:35], 32, cache, block_size=8, commit=False, context_end=38, logits_at=[1, 2])]
        with pytest.raises(IndexError):
            model(ids[:, 32:35], 32, cache, logits_at=[3])
        packed = model.new_cache(48, batch=4)
        for row in range(3):
            model(ids[row % 2:row % 2 + 1, :12], 0, packed.row(row), block_size=8)
        tokens = [ids[1, 12:15].tolist(), ids[0, 12:17].tolist(), ids[0, 16:18].tolist()]
        bucketed = Ragged.pack([1, 0, 2], [12, 12, 12], tokens, model.device, padding_row=3, capacity=48)
        out += [*model.forward_ragged(bucketed, packed, taps=(1,)),
                model.forward_ragged(bucketed, packed, logits_at=torch.tensor([2, -1]))]
        ragged = Ragged.pack([1, 0, 2], [12, 12, 16], tokens, model.device)
        out.append(model.forward_ragged(ragged, packed, block_size=8, context_ends=[15, 20, 18],
                                        head_weight=reduced))
        return out + cache.keys + cache.values + packed.keys + packed.values

    with torch.inference_mode():
        assert model._kernel_layers(1, model.new_cache(4)) is not None  # the kept weights the call reads
        assert model._whole_forward(ids[:1, :1], None, 0, 1, 0, model.new_cache(4), [0], None, ()) is not None
        whole = forwards()
        with monkeypatch.context() as patch:
            patch.setattr(Transformer, "_whole_forward", lambda *args: None)
            per_layer = forwards()
    assert [t.shape for t in whole] == [t.shape for t in per_layer]
    assert all(torch.equal(a, b) for a, b in zip(whole, per_layer, strict=True))


@AVX512
def test_row_picks_are_each_rows_argmax_and_softmax_probability():
    """The first index of the largest value among the first `limit` columns (ties and NaN as
    `argmax` has them), and its softmax probability within float32 rounding."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 4
    logits[1, 7] = logits[1, 250] = logits[1].max() + 1  # a tie: the first one wins
    logits[2, 250:] = 50.0  # past the limit: never picked
    logits[2, 260] = float("nan")
    logits[3] = float("-inf")
    logits[3, 123] = -5.0  # one finite value: probability 1
    logits[4, 17] = logits[4, 33] = float("nan")  # argmax takes the first NaN
    limit = 250
    ids, confs = cpu_kernels.kernels().row_picks(logits, limit, True)
    seen = logits[:, :limit]
    assert ids == seen.argmax(-1).tolist() and ids[1] == 7 and ids[2] < 250 and ids[3] == 123 and ids[4] == 17
    expected = torch.softmax(seen.double(), dim=-1).max(dim=-1).values
    torch.testing.assert_close(torch.tensor(confs[:4] + confs[5:], dtype=torch.float64),
                               torch.cat([expected[:4], expected[5:]]), rtol=1e-6, atol=0)
    assert confs[3] == 1.0 and confs[4] != confs[4]  # NaN
    assert cpu_kernels.kernels().row_picks(logits, limit, False) == (ids, [])
    assert cpu_kernels.kernels().row_picks(logits, None, False)[0][2] == 260  # no limit: every column
    logits[5] = float("-inf")
    assert cpu_kernels.kernels().row_picks(logits, limit, True)[1][5] != cpu_kernels.kernels().row_picks(
        logits, limit, True)[1][5]  # no finite value: NaN, as softmax gives
    for other in (logits.double(), logits.t(), logits[0], logits[:, :0]):  # PyTorch picks these
        assert cpu_kernels.kernels().row_picks(other, None, False) is None
    with pytest.raises(RuntimeError, match="limit"):
        cpu_kernels.kernels().row_picks(logits, 301, False)


@AVX512
def test_greedy_picks_of_float32_logits_are_the_torch_picks(random_models, monkeypatch):
    """`greedy_tokens` and a drafter's `picks` take the kernel for float32 logits (counted) and
    pick what PyTorch's argmax and softmax pick for the same logits in float64 (PyTorch's path):
    a drafter with a draft vocabulary through it, one without over its first `vocab_limit`
    columns. A sampling drafter keeps PyTorch's path."""
    from failfast.decode.sampling import Sampler, SamplingParams, greedy_tokens
    from failfast.drafters.base import ModelDrafter

    calls = []
    real = cpu_kernels.kernels().row_picks
    monkeypatch.setattr(cpu_kernels.kernels(), "row_picks", lambda *args: calls.append(args[0].dtype) or real(*args))
    logits = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    assert greedy_tokens(logits) == greedy_tokens(logits.double()) == logits.argmax(-1).tolist()
    assert calls == [torch.float32, torch.float64]  # float64 is turned down, PyTorch picks it
    loaded = load_model(random_models["random-ar"])
    reduced = logits[:, :32].contiguous()
    for drafter, rows, columns in ((ModelDrafter(loaded, 96, draft_vocab=range(0, 96, 3)), reduced, range(0, 96, 3)),
                                   (ModelDrafter(loaded, 50), logits, range(50))):
        tokens, confs = drafter.picks(rows, range(5))
        torch_tokens, torch_confs = drafter.picks(rows.double(), range(5))
        assert tokens == torch_tokens == [columns[i] for i in rows[:, :len(columns)].argmax(-1).tolist()]
        torch.testing.assert_close(torch.tensor(confs), torch.tensor(torch_confs), rtol=1e-6, atol=0)
    assert calls.count(torch.float32) == 3
    sampling = ModelDrafter(loaded, 96)
    sampling.sample_with(Sampler(SamplingParams(temperature=0.8, seed=0), 96))
    calls.clear()
    sampling.picks(logits, range(5))
    assert calls == []


@AVX512
def test_a_parameter_watch_reads_version_counters_and_which_tensors_train():
    """`KernelPlan`'s state in one call: it moves with an in-place change and with
    `requires_grad`, and is None where a tensor keeps no version counter."""
    kernels = cpu_kernels.kernels()
    a, b = torch.zeros(3), torch.ones(2)
    watch = kernels.ParameterWatch([a, b])
    versions, training = kernels.parameter_state(watch)
    assert training == [] and versions == a._version + b._version
    b.add_(1)
    assert kernels.parameter_state(watch) == (versions + 1, [])
    b.requires_grad_(True)
    assert kernels.parameter_state(watch) == (versions + 1, [1])
    with torch.inference_mode():
        frozen = torch.zeros(1)
    assert kernels.parameter_state(kernels.ParameterWatch([a, frozen])) is None


@AVX512
def test_an_eagle3_step_with_its_logits_in_one_call_computes_the_bits_of_its_parts(tmp_path, monkeypatch):
    """`step_logits` as one stack_forward call (hidden states as the residual input, the layer's
    output tapped) gives the bits of `step_rows` in one call per layer, then the norm and the
    head: the target's head and a reduced one, three rows at different positions; the written
    K/V too."""
    from failfast.model.packed import pack_weight

    target_cfg, target, drafter = attached_drafter(tmp_path, tiny_eagle3_config)
    gen = torch.Generator().manual_seed(4)
    context = torch.randn(3, 8, target_cfg.hidden_size, generator=gen)
    tokens, hidden = torch.randint(0, 120, (3, 9), generator=gen), torch.randn(3, 1, target_cfg.hidden_size, generator=gen)
    reduced = pack_weight(target.lm_head.weight[::3].contiguous())
    assert isinstance(reduced, TiledWeight)
    calls = []
    real = cpu_kernels.kernels().stack_forward

    def counting(*args, **kwargs):
        calls.append(kwargs.get("hidden") is not None)
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu_kernels.kernels(), "stack_forward", counting)

    def step(head):
        cache = drafter.new_cache(16, batch=3)
        for row, length in enumerate((5, 3, 7)):
            drafter.write_context(tokens[row:row + 1, :length], context[row:row + 1, :length], 0, cache.row(row))
        out, logits = drafter.step_logits(tokens[[0, 2, 1], 8:9], hidden, [0, 2, 1], [5, 7, 3], cache, head)
        return [out, logits, *cache.keys, *cache.values]

    with torch.inference_mode():
        for head in (None, reduced):
            whole = step(head)
            assert calls == [True] and whole[1].shape == (3, 120 if head is None else 40)
            with monkeypatch.context() as patch:
                patch.setattr(Eagle3Model, "_whole_step", lambda *args: None)
                parts = step(head)
            assert calls == [True]
            calls.clear()
            for a, b in zip(whole, parts, strict=True):
                assert torch.equal(a, b)


@AVX512
def test_greedy_eagle3_drafts_of_several_steps_in_one_call_are_the_step_by_step_drafts(tmp_path, monkeypatch):
    """`Eagle3Drafter.draft` of several greedy tokens in one `chain_steps` call drafts the
    tokens and confidences of the steps one at a time, and leaves the same last output, cache
    and written K/V: with the target's vocabulary and with a draft vocabulary's map. A draft
    of one token takes the step path."""
    from failfast.drafters.eagle3 import Eagle3Drafter

    target_cfg = tiny_config(vocab_size=120, intermediate_size=96)
    target = load_model(write_model(tmp_path / "t", target_cfg, seed=0))
    loaded = load_model(write_model(tmp_path / "d", tiny_eagle3_config(target_cfg), seed=1))
    ids = torch.randint(0, 120, (1, 14), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        features = target.model.features(ids, loaded.config.target_layer_ids)[0]
    steps = []
    real = cpu_kernels.kernels().chain_steps
    monkeypatch.setattr(cpu_kernels.kernels(), "chain_steps", lambda *args: steps.append(args[4]) or real(*args))

    def drafts(draft_vocab):
        drafter = Eagle3Drafter(loaded, target, 120, draft_vocab)
        drafter.prepare(30)
        drafter.add_context(0, features[:13])
        with torch.inference_mode():
            drafter.begin(ids[0].tolist())
            out = [drafter.draft(3), drafter.draft(1), drafter.draft(4)]
        return out, [drafter.hidden, *drafter.cache.keys, *drafter.cache.values], [drafter.cache.length,
                                                                                   drafter.next_position]

    for draft_vocab in (None, list(range(0, 120, 2))):
        chained = drafts(draft_vocab)
        assert steps == [3, 4]
        with monkeypatch.context() as patch:
            patch.setattr(Eagle3Model, "greedy_chain", lambda *args: None)
            stepped = drafts(draft_vocab)
        steps.clear()
        assert chained[0] == stepped[0] and chained[2] == stepped[2] == [20, 22]
        assert all(len(tokens) == len(confs) for tokens, confs in chained[0])
        assert all(torch.equal(a, b) for a, b in zip(chained[1], stepped[1], strict=True))
        if draft_vocab is not None:
            assert all(t % 2 == 0 for tokens, _ in chained[0] for t in tokens)


@AVX512
def test_greedy_ar_drafts_of_several_steps_in_one_call_are_the_step_by_step_drafts(tmp_path, monkeypatch):
    """`ARDrafter.draft` of several greedy tokens in one `chain_steps` call (its first step
    feeding the pending tokens: a prompt, then a round's accepted tokens) drafts the step-by-step
    tokens and confidences and leaves the same cache: with and without a draft vocabulary, and
    with a column limit that binds. Picks that are not plain argmaxes take the step path."""
    from failfast.drafters.autoregressive import ARDrafter

    loaded = load_model(write_model(tmp_path / "d", tiny_config(vocab_size=120, intermediate_size=96), seed=2))
    ids = torch.randint(0, 120, (14,), generator=torch.Generator().manual_seed(7)).tolist()
    steps = []
    real = cpu_kernels.kernels().chain_steps
    monkeypatch.setattr(cpu_kernels.kernels(), "chain_steps", lambda *args: steps.append((len(args[1]), args[4]))
                        or real(*args))

    def drafts(draft_vocab, vocab_limit=120):
        drafter = ARDrafter(loaded, vocab_limit, draft_vocab=draft_vocab)
        drafter.prepare(40)
        with torch.inference_mode():
            drafter.begin(ids[:10])
            out = [drafter.draft(3), drafter.draft(1)]
            drafter.begin(ids[:10] + out[0][0][:1] + ids[12:14])  # one accepted, then other tokens
            out.append(drafter.draft(5))
        return out, [*drafter.cache.keys, *drafter.cache.values], [drafter.cache.length, drafter.cache_ids,
                                                                  drafter._pending, drafter.forwards]

    drafted = {}
    for draft_vocab, limit in ((None, 120), (list(range(1, 120, 3)), 120), (None, 60)):
        chained = drafts(draft_vocab, limit)
        assert steps == [(10, 3), (2, 5)]  # the prompt; the two tokens after the accepted one
        with monkeypatch.context() as patch:
            patch.setattr(Transformer, "greedy_chain", lambda *args: None)
            stepped = drafts(draft_vocab, limit)
        steps.clear()
        assert chained[0] == stepped[0] and chained[2] == stepped[2] and chained[2][0] == 17
        assert all(torch.equal(a, b) for a, b in zip(chained[1], stepped[1], strict=True))
        drafted[draft_vocab is not None, limit] = [t for tokens, _ in chained[0] for t in tokens]
    assert all(t % 3 == 1 for t in drafted[True, 120])
    assert max(drafted[False, 120]) >= 60 > max(drafted[False, 60])  # the column limit binds
    banning = ARDrafter(loaded, 120)  # a banned token (as sampling or penalties) takes the step path
    banning.banned = [5]
    banning.prepare(40)
    with torch.inference_mode():
        banning.begin(ids[:10])
        assert len(banning.draft(4)[0]) == 4 and steps == []


@AVX512
def test_eagle3_context_writes_in_one_call_compute_the_op_by_op_keys_and_values(tmp_path, monkeypatch):
    """`write_context` in one call (`slot_kv`: [normed embedding, normed hidden] through the
    fused q/k/v tiles) writes the op-by-op keys and values up to float32 rounding, at the
    slots' positions only, and the chain step after it reads them alike."""
    target_cfg, target, drafter = attached_drafter(tmp_path, tiny_eagle3_config)
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(1, 9, target_cfg.hidden_size, generator=gen)
    tokens = torch.randint(0, 120, (1, 10), generator=gen)
    calls = []
    real = cpu_kernels.kernels().slot_kv
    monkeypatch.setattr(cpu_kernels.kernels(), "slot_kv", lambda *args: calls.append(1) or real(*args))

    def written():
        cache = drafter.new_cache(16)
        drafter.write_context(tokens[:, 1:5], fused[:, :4], 0, cache)
        drafter.write_context(tokens[:, 5:10], fused[:, 4:9], 4, cache)
        out, logits = drafter.step_logits(tokens[:, 9:10], fused[:, 8:9], [0], [9], cache)
        return [cache.keys[0], cache.values[0], out, logits]

    with torch.inference_mode():
        one_call = written()
        assert len(calls) == 2
        with monkeypatch.context() as patch:
            patch.setattr(Eagle3Model, "_kernel_weights", lambda *args: None)
            op_by_op = written()
    assert len(calls) == 2
    assert one_call[0][:, :, 10:].abs().sum() == 0 == one_call[1][:, :, 10:].abs().sum()  # nothing past the slots
    for a, b in zip(one_call, op_by_op, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@AVX512
def test_dflash_passes_with_their_logits_in_one_call_compute_the_bits_of_their_parts(tmp_path):
    """`pass_logits` (packed blocks, norm and head in one stack_forward call) gives the bits of
    `draft_passes`, the norm and the head at each block's last masks: three rows at different
    contexts and widths, the target's head and a reduced one; None where a block would end
    past the cache (the caller runs the parts)."""
    from failfast.model.packed import pack_weight

    target_cfg, target, drafter = attached_drafter(tmp_path, lambda cfg: tiny_dflash_config(cfg, num_hidden_layers=2))
    gen = torch.Generator().manual_seed(6)
    features = torch.randn(3, 9, 2 * target_cfg.hidden_size, generator=gen)
    windows = [torch.randint(0, 120, (n,), generator=gen).tolist() for n in (4, 7, 5)]
    rows, lengths, masks = [0, 2, 1], [5, 9, 3], [3, 6, 5]
    reduced = pack_weight(target.lm_head.weight[::2].contiguous())
    with torch.inference_mode():
        for head in (None, reduced):
            cache = drafter.new_cache(24, batch=3)
            for row, length in enumerate(lengths):
                drafter.write_context(features[row:row + 1, :length], 0, cache.row(row))
            starts = [lengths[r] for r in rows]
            whole = drafter.pass_logits(windows, rows, starts, cache, masks, head)
            parts = [drafter.lm_head(h[-m:]) if head is None else linear(h[-m:], head)
                     for h, m in zip(drafter.draft_passes(windows, rows, starts, cache), masks)]
            assert [w.shape for w in whole] == [(m, 120 if head is None else 60) for m in masks]
            assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))
        assert drafter.pass_logits(windows, rows, [20, 20, 20], cache, masks) is None
