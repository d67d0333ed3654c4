"""Median ms per forward after a context, by dtype: float32 unpacked (row-major weights,
separate q/k/v and gate/up products) and packed (column-major and fused, the runtime's),
bfloat16 with PyTorch's SDPA (fast, not batch-invariant) and bfloat16 with the
batch-invariant attention the runtime uses for 16-bit inference (README, "Precision").
Interleaved, warmed up.

    python scripts/forward_costs.py [--models target,dllm-drafter] [--tokens 1,8,16,32,64] [--context 256]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from failfast.embedded import resolve_model
from failfast.model import load_model, transformer


def forward_ms(model: transformer.Transformer, context: int, tokens: int, repeats: int) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, context + tokens), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(context + tokens)
    model(ids[:, :context], 0, cache)
    times = []
    for _ in range(repeats):
        cache.length = context
        start = time.perf_counter()
        model(ids[:, context:], context, cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="target,dllm-drafter")
    ap.add_argument("--tokens", default="1,8,16,32,64")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    half = transformer.HALF_DTYPES
    for name in args.models.split(","):
        models = {dt: load_model(resolve_model(name), dtype=dt).model for dt in (torch.float32, torch.bfloat16)}
        unpacked = load_model(resolve_model(name), dtype=torch.float32, pack=False).model
        with torch.inference_mode():
            for t in map(int, args.tokens.split(",")):
                row = {}
                for _ in range(2):  # the first sweep warms up; the second is reported
                    row["float32 unpacked"] = forward_ms(unpacked, args.context, t, args.repeats)
                    row["float32"] = forward_ms(models[torch.float32], args.context, t, args.repeats)
                    transformer.HALF_DTYPES = ()
                    row["bf16 sdpa"] = forward_ms(models[torch.bfloat16], args.context, t, args.repeats)
                    transformer.HALF_DTYPES = half
                    row["bf16 batch-invariant"] = forward_ms(models[torch.bfloat16], args.context, t, args.repeats)
                print(name, f"{t:3d} tokens", "  ".join(f"{k} {v:6.2f} ms" for k, v in row.items()))


if __name__ == "__main__":
    main()
