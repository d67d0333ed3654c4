"""A bounded load test of `failfast serve` against `failfast batch` on the same prompts.

Starts the server (embedded models unless told otherwise) as its own process on a free
port, sends `--requests` greedy completions from `--clients` concurrent clients (prompts
cycled from the dataset), then stops it and runs `failfast batch` over the same requests
with the same batch size. Prints errors, p50 / p99 latency and aggregate tokens/s of both,
and how many outputs differ (float32 batches of different composition may round a near-tie
differently; float64 never does).

    python scripts/serve_load_test.py --requests 200 --clients 32 --max-tokens 64 --max-batch 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from failfast.bench.datasets import load_dataset
from failfast.serve.process import free_port, wait_healthy


async def _load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int) -> dict:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    latencies: list[float] = []
    texts: dict[int, str] = {}
    errors: list[str] = []
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            t0 = time.perf_counter()
            r = await http.post(url + "/v1/completions", json={"model": model, "prompt": prompts[i],
                                                               "max_tokens": max_tokens, "temperature": 0})
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:200]}")
                continue
            latencies.append(time.perf_counter() - t0)
            body = r.json()
            texts[i] = body["choices"][0]["text"]
            tokens += body["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - started
    return {"wall_s": wall, "tokens": tokens, "errors": errors, "latencies": sorted(latencies), "texts": texts}


def _percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("model_flags", nargs=argparse.REMAINDER, help="after --: flags for serve and batch "
                   "(e.g. -- --policy ar)")
    args = p.parse_args()
    flags = [f for f in args.model_flags if f != "--"]
    pool = [q.text for q in load_dataset(args.dataset)]
    prompts = [pool[i % len(pool)] for i in range(args.requests)]
    exe = [sys.executable, "-m", "failfast.cli"]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([*exe, "serve", "--port", str(port), "--max-batch", str(args.max_batch),
                               "--max-queue", str(args.requests), "--threads", str(args.threads), *flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(url, server, 120)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(_load(url, model, prompts[:args.clients], args.clients, 8))  # warm-up
        served = asyncio.run(_load(url, model, prompts, args.clients, args.max_tokens))
    finally:
        server.terminate()
        server.wait(30)

    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        inp.write_text("".join(json.dumps({"id": i, "prompt": t}) + "\n" for i, t in enumerate(prompts)))
        job = subprocess.run([*exe, "batch", "--input", str(inp), "--output", str(out), "--batch-size",
                              str(args.max_batch), "--max-new-tokens", str(args.max_tokens), *flags],
                             check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        rows = [json.loads(line) for line in out.read_text().splitlines()]
    # the job's own summary: "N rows generated (T tokens in S s)", decoding time without model loading
    summary = re.search(r"\((\d+) tokens in ([\d.]+)s\)", job.stderr)
    batch_tokens, batch_wall = int(summary[1]), float(summary[2])
    batch_texts = {r["id"]: r["text"] for r in rows}
    differ = sum(served["texts"].get(i) != batch_texts.get(i) for i in range(len(prompts)))
    lat = served["latencies"]
    print(f"serve: {len(prompts)} requests from {args.clients} clients, {len(served['errors'])} errors, "
          f"latency p50 {_percentile(lat, 0.5):.2f}s p99 {_percentile(lat, 0.99):.2f}s, "
          f"{served['tokens'] / served['wall_s']:.1f} tok/s aggregate ({served['wall_s']:.1f}s)")
    print(f"batch: {len(rows)} rows, {batch_tokens / batch_wall:.1f} tok/s ({batch_wall:.1f}s)")
    print(f"outputs that differ between serve and batch: {differ}")
    for e in served["errors"][:5]:
        print("error:", e)


if __name__ == "__main__":
    main()
