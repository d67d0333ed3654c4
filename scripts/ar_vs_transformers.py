"""Plain AR greedy decoding: failfast's runtime vs transformers `generate`, same weights.

A slow baseline would inflate every speedup we report, so ours must be at least as fast.
Methods are interleaved per repeat after a warm-up; the ratio of medians is reported.

    python scripts/ar_vs_transformers.py [--new-tokens 128] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen2ForCausalLM

from failfast import SpeculativeEngine, load_model
from failfast.model import ModelConfig, Transformer
from failfast.model.checkpoint import save_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp()) / "random-25m"
    cfg = ModelConfig(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    save_model(model, folder)
    params = sum(p.numel() for p in model.parameters())  # tied head counted once
    ours = SpeculativeEngine(load_model(folder))
    ref = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = torch.randint(0, 8192, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(1))

    def run_ours() -> list[int]:
        return ours.generate(prompt[0].tolist(), args.new_tokens).token_ids

    def run_hf() -> list[int]:
        with torch.inference_mode():
            out = ref.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                               min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[0, args.prompt_tokens:].tolist()

    assert run_ours() == run_hf(), "plain AR tokens differ from transformers"
    times: dict[str, list[float]] = {"failfast": [], "transformers": []}
    for _ in range(args.repeats):
        for name, fn in (("failfast", run_ours), ("transformers", run_hf)):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"target: {params / 1e6:.1f}M parameters, float32, {torch.get_num_threads()} threads; "
          f"prompt {args.prompt_tokens}, new tokens {args.new_tokens}, {args.repeats} interleaved repeats")
    for k, v in med.items():
        print(f"{k:>12}: median {v:.3f}s ({args.new_tokens / v:.1f} tok/s)")
    print(f"failfast speed / transformers speed = {med['transformers'] / med['failfast']:.2f}x")


if __name__ == "__main__":
    main()
