"""vLLM with failfast's proposer, end to end on the embedded models (needs the vllm extra,
which lives in its own environment: `make test-vllm`; README, "vLLM")."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here; `make test-vllm` runs these tests in .venv-vllm")

from failfast import SpeculativeEngine, load_model  # noqa: E402
from failfast.embedded import resolve_model  # noqa: E402
from failfast.integrations.vllm import ProposerConfig  # noqa: E402
from failfast.integrations.vllm_peers import VllmGenerator, speculative_config  # noqa: E402

PROMPTS = ["def fib(n):\n", "import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n",
           "class Stack:\n    def __init__(self):\n", "    for i in range(10):\n"]
MAX_NEW = [48, 20, 33, 40]  # requests end at different steps; with 2 slots, later ones start as others end


def test_vllm_with_the_failfast_proposer_gives_plain_ar_tokens():
    target = load_model(resolve_model("target"), dtype=torch.float32)
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    plain = SpeculativeEngine(target)
    want = [plain.generate(p, n).token_ids for p, n in zip(prompts, MAX_NEW)]
    vllm = VllmGenerator(resolve_model("target"), torch.float32, speculative_config("vllm-failfast"),
                         ProposerConfig(dtype="float32"), max_model_len=512, max_num_seqs=2)
    try:
        assert vllm.generate(prompts, MAX_NEW) == want
        assert vllm.accepted_draft_tokens() > 0  # the proposer's drafts were verified and accepted
    finally:
        vllm.close()
