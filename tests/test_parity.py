"""Our transformer's logits equal transformers' Qwen2ForCausalLM / Qwen3ForCausalLM (float64, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from failfast.model import load_model
from tests.helpers import tiny_config, write_model

CONFIGS = {
    "gqa-untied": tiny_config(),
    "mha-tied": tiny_config(num_key_value_heads=4, tie_word_embeddings=True),
    "gqa-deeper": tiny_config(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                              num_hidden_layers=3, intermediate_size=80, rope_theta=1e6),
    "mqa": tiny_config(num_key_value_heads=1),
    # Qwen3: per-head q/k RMSNorm, no q/k/v bias, head_dim from config (here not hidden / heads)
    "qwen3": tiny_config(model_type="qwen3", qk_norm=True, attention_bias=False, head_dim=16),
    "qwen3-tied-biased": tiny_config(model_type="qwen3", qk_norm=True, attention_bias=True,
                                     tie_word_embeddings=True, num_key_value_heads=1),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_and_cached_decode_match_transformers(tmp_path, name):
    folder = write_model(tmp_path / name, CONFIGS[name], seed=3)
    ours = load_model(folder, dtype=torch.float64).model
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    assert type(ref).__name__ == ("Qwen3ForCausalLM" if CONFIGS[name].qk_norm else "Qwen2ForCausalLM")
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        cache = ours.new_cache(64)
        prefill = ours(ids[:, :15], 0, cache)
        # Cached decode: one token at a time, then a multi-token chunk (as verification does).
        steps = [ours(ids[:, i:i + 1], i, cache) for i in range(15, 19)]
        chunk = ours(ids[:, 19:], 19, cache)
    got = torch.cat([prefill, *steps, chunk], dim=1)
    # transformers normalises in float32 even for float64 models; we keep float64 there,
    # so agreement is to float32 precision rather than float64 precision.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
