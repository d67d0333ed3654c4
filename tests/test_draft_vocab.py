"""A drafter's reduced vocabulary: drafts only from it, the same argmax over it as the full
head, still lossless; the vocabulary stage keeps the target's most frequent tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from failfast import FailFast, Fixed, SpeculativeEngine, load_model, make_drafter
from failfast.decode.engine import GenerationRequest
from failfast.decode.policies import CostAware
from failfast.drafters.factory import DRAFT_VOCAB_FILE
from failfast.errors import CheckpointError
from failfast.train.draft_vocab import write_draft_vocab
from failfast.train.selfdistill import MANIFEST_FILE
from tests.helpers import copy_checkpoint, prompt_of
from tests.test_lossless import CPU_COSTS, hf_greedy

KEEP = list(range(2, 90, 2)) + [95]  # even ids, and the dLLM drafter's mask token


@pytest.mark.parametrize("drafter_name", ["self", "random-ar", "random-dllm"])
def test_a_reduced_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(random_models, tmp_path, drafter_name):
    folder = copy_checkpoint(random_models[drafter_name], tmp_path / "drafter")
    (folder / DRAFT_VOCAB_FILE).write_text(json.dumps({"ids": KEEP}))
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter_model = load_model(folder, dtype=torch.float64)
    reduced, full = make_drafter(target, drafter_model), make_drafter(target, drafter_model, full_vocab=True)
    allowed = sorted(set(KEEP) - set(reduced.banned))  # a block drafter never drafts its mask token
    assert reduced.vocab_ids.tolist() == allowed and full.vocab_ids is None
    assert (95 in allowed) == (drafter_name != "random-dllm")
    prompt = prompt_of(9)
    for d in (reduced, full):
        d.prepare(60)
        d.begin(prompt)
    tokens, confs = reduced.draft(12)
    assert set(tokens) <= set(allowed) and all(0 < c <= 1 for c in confs)
    if drafter_name != "random-dllm":  # AR: the first draft token is the full head's argmax over the kept rows
        logits = full.model(torch.tensor([prompt]), 0, full.cache, logits_at=slice(-1, None))[0, -1]
        assert tokens[0] == allowed[int(logits[reduced.vocab_ids].argmax())]
    expected = hf_greedy(random_models["target"], prompt, 40)
    for policy in (Fixed(4), FailFast(tau=0.0, chunk=3, max_draft=20), CostAware(CPU_COSTS, chunk=4, max_draft=24)):
        result = SpeculativeEngine(target, make_drafter(target, drafter_model), policy).generate(prompt, 40)
        assert result.token_ids == expected, policy.name
    batch = SpeculativeEngine(target, make_drafter(target, drafter_model), Fixed(4))
    requests = [(prompt_of(n), 30) for n in (3, 9, 17)]
    got = dict(batch.generate_many([GenerationRequest(p, m) for p, m in requests], batch_size=3))
    assert [got[i].token_ids for i in range(3)] == [hf_greedy(random_models["target"], p, m) for p, m in requests]


def test_draft_vocab_stage_keeps_the_most_frequent_target_tokens(tmp_path):
    rows = np.array([[7, 7, 3, 3, 3, 5], [7, 7, 3, 5, 9, 9]], dtype=np.uint16)  # prompt_len 2
    (tmp_path / "rows").mkdir()
    np.save(tmp_path / "rows" / "rows-00000.npy", rows)
    (tmp_path / "rows" / MANIFEST_FILE).write_text(json.dumps({"settings": {"prompt_len": 2}}))
    (tmp_path / "drafter").mkdir()
    out = write_draft_vocab(tmp_path / "rows", tmp_path / "drafter", 2)
    assert out["ids"] == [3, 5] and out["coverage"] == pytest.approx(6 / 8)  # 7 is prompt only
    assert json.loads((tmp_path / "drafter" / DRAFT_VOCAB_FILE).read_text())["ids"] == [3, 5]


def test_a_broken_draft_vocabulary_is_a_clear_error(random_models, tmp_path):
    folder = copy_checkpoint(random_models["random-ar"], tmp_path / "drafter")
    (folder / DRAFT_VOCAB_FILE).write_text('{"ids": "all"}')
    target = load_model(random_models["target"], dtype=torch.float64)
    with pytest.raises(CheckpointError, match="list of token ids"):
        make_drafter(target, load_model(folder, dtype=torch.float64))
