"""Batched decoding: every row equals its single-sequence output (float64, CPU), whatever the
drafter, policy, prompt lengths, finishing rounds, joining order and sampling seeds; batched
drafting (every drafter kind) proposes exactly the drafts each row would alone."""

from __future__ import annotations

import pytest
import torch

from failfast import FailFast, Fixed, SamplingParams, SpeculativeEngine, load_model, make_drafter
from failfast.decode.engine import GenerationRequest
from failfast.decode.policies import CostAware
from failfast.model import Transformer
from failfast.model.ragged import Ragged
from tests.helpers import copy_checkpoint, prompt_of, set_eos, write_word_tokenizer
from tests.test_lossless import CPU_COSTS

POLICIES = [Fixed(4), FailFast(tau=0.0, chunk=3, max_draft=20), CostAware(CPU_COSTS, chunk=4, max_draft=24)]
LENGTHS = [1, 2, 7, 8, 9, 17, 30]          # the dLLM drafter's block size is 8
MAX_NEW = [40, 5, 23, 1, 40, 12, 33]       # rows finish in different rounds


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(prompt_of(n, seed=i), m, SamplingParams(0.9, top_p=0.95, seed=i) if i % 2 else None)
            for i, (n, m) in enumerate(zip(LENGTHS, MAX_NEW))]


def _check_batches(engine: SpeculativeEngine, requests: list[GenerationRequest]) -> None:
    single = [engine.generate(r.prompt_ids, r.max_new_tokens, r.sampling, r.stop) for r in requests]
    for batch_size in (2, 3, len(requests)):  # 2 and 3: rows join as others finish
        finished = list(engine.generate_many(requests, batch_size))
        assert sorted(i for i, _ in finished) == list(range(len(requests)))
        got = dict(finished)
        for i, want in enumerate(single):
            assert got[i].token_ids == want.token_ids, (batch_size, i)
            assert got[i].stop_reason == want.stop_reason and got[i].text == want.text
            assert got[i].stats.tokens == len(want.token_ids)
            # the same drafts, round by round: batched drafting drafts what one row would
            rounds = lambda r: [(x.drafted, x.accepted, x.drafter_forwards) for x in r.stats.trajectory]  # noqa: E731
            assert rounds(got[i]) == rounds(want), (batch_size, i)


@pytest.mark.parametrize("drafter_name", [None, "self", "random-ar", "random-dllm", "random-dflash", "random-eagle3"])
def test_random_drafters_in_batches(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    requests = _requests()
    if drafter_name is None:
        _check_batches(SpeculativeEngine(target), requests)
        return
    drafter = load_model(random_models[drafter_name], dtype=torch.float64)
    for policy in POLICIES:
        _check_batches(SpeculativeEngine(target, make_drafter(target, drafter), policy), requests)


def test_rows_finish_out_of_order_and_join_mid_run(random_models):
    target = load_model(random_models["target"], dtype=torch.float64)
    order = [i for i, _ in SpeculativeEngine(target).generate_many(_requests(), batch_size=3)]
    assert order != sorted(order) and order[0] == 1  # the 5-token row finishes first, before row 0


def test_trained_drafter_long_drafts_eos_and_stop_strings_in_batches(trained_pair, tmp_path):
    target_dir, drafter_dir = trained_pair
    folder = copy_checkpoint(target_dir, tmp_path / "target-eos")
    set_eos(folder, 20)  # counting prompts reach it at different rounds
    write_word_tokenizer(folder, 48)
    target = load_model(folder, dtype=torch.float64)
    drafter = load_model(drafter_dir, dtype=torch.float64)
    requests = [GenerationRequest(list(range(3, 8)), 60), GenerationRequest(list(range(21, 30)), 60),
                GenerationRequest(list(range(0, 6)), 60, stop=("<12>",)),
                GenerationRequest([5], 10), GenerationRequest(list(range(22, 38)), 50, SamplingParams(1.0, seed=4))]
    engine = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(0.45, 10, 40))
    _check_batches(engine, requests)
    results = dict(engine.generate_many(requests))
    assert {r.stop_reason for r in results.values()} == {"eos", "stop", "length"}
    assert max(r.accepted for r in results[1].stats.trajectory) >= 8  # long drafts accepted inside a batch


def test_a_long_prompt_joining_a_batch_with_an_ar_drafter(random_models):
    """A joining row's drafter first feeds its whole prompt; the other rows must not pay for
    (or overflow their cache rows with) that width."""
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["self"], dtype=torch.float64)
    requests = [GenerationRequest(prompt_of(100), 60), GenerationRequest(prompt_of(3), 5),
                GenerationRequest(prompt_of(150), 20)]
    _check_batches(SpeculativeEngine(target, make_drafter(target, drafter), Fixed(4)), requests)


@pytest.mark.parametrize("drafter_name", [None, "random-dflash"])
def test_rows_joining_together_prefill_in_one_forward(random_models, monkeypatch, drafter_name):
    """Requests added between two steps fill their cache rows in one packed forward (the
    DFlash drafter gets each row's prompt features from it), and decode exactly as alone."""
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = None if drafter_name is None else make_drafter(target, load_model(random_models[drafter_name],
                                                                                dtype=torch.float64))
    engine = SpeculativeEngine(target, drafter, None if drafter is None else FailFast(0.0, 3, 12))
    prefills = []  # rows of each packed forward that starts every row at position 0
    real = Transformer.forward_ragged

    def recording(self, ragged, cache, **kwargs):
        if set(ragged.starts) == {0}:
            prefills.append(len(ragged.rows))
        return real(self, ragged, cache, **kwargs)
    monkeypatch.setattr(Transformer, "forward_ragged", recording)
    requests = [GenerationRequest(prompt_of(n, seed=n), 10) for n in (9, 30, 1, 17)]  # the 1-token prompt needs none
    _check_batches(engine, requests)
    assert 3 in prefills  # batch size 4: the three prompts longer than one token, together


@pytest.mark.parametrize("drafter_name", ["random-ar", "random-dllm"])
def test_a_cancelled_row_leaves_between_rounds_and_a_new_one_takes_its_slot(random_models, drafter_name):
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = make_drafter(target, load_model(random_models[drafter_name], dtype=torch.float64))
    engine = SpeculativeEngine(target, drafter, FailFast(tau=0.0, chunk=3, max_draft=20))
    requests = _requests()
    batch = engine.open_batch(3, max(len(r.prompt_ids) + r.max_new_tokens for r in requests), 40)
    for i in (0, 2, 4):
        batch.add(i, requests[i])
    finished = dict(batch.step() + batch.step())
    assert 0 in batch.generated() and batch.cancel(0) and not batch.cancel(0) and batch.free_slots == 1
    batch.add(6, requests[6])  # joins the slot row 0 left, over that row's stale cache
    while batch.running:
        finished.update(batch.step())
    assert sorted(finished) == [2, 4, 6]
    for i in (2, 4, 6):
        r = requests[i]
        assert finished[i].token_ids == engine.generate(r.prompt_ids, r.max_new_tokens, r.sampling).token_ids


@pytest.mark.parametrize("denoise, threshold", [("sliding", 0.0), ("sliding", 0.5), ("prefix", 0.0), ("sub-block", 0.0),
                                                ("full-block", 0.0)])
def test_block_diffusion_rows_denoise_together(random_models, monkeypatch, denoise, threshold):
    """In a batch, rows that need a denoising pass run it in one packed forward, and every row
    still drafts what it drafts alone (the round records of `_check_batches`)."""
    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["random-dllm"], dtype=torch.float64)
    engine = SpeculativeEngine(target, make_drafter(target, drafter, threshold, denoise), FailFast(tau=0.0, chunk=3, max_draft=20))
    rows_per_pass = []
    real = Transformer.forward_ragged

    def recording(self, ragged, cache, **kw):
        if kw.get("block_size") is not None:
            rows_per_pass.append(len(ragged.rows))
        return real(self, ragged, cache, **kw)
    monkeypatch.setattr(Transformer, "forward_ragged", recording)
    _check_batches(engine, _requests())
    assert max(rows_per_pass) == len(LENGTHS) - 1  # every row but the one-token one (it never drafts)


def test_causal_window_rows_draft_together(random_models, monkeypatch):
    """Rows drafting causal windows run them in one packed forward and draft what each drafts
    alone (the round records of `_check_batches`), with every policy."""
    from failfast.drafters.causal_window import CausalWindowDrafter

    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["random-dllm"], dtype=torch.float64)
    rows_per_pass = []
    real = CausalWindowDrafter.draft_rows

    def recording(drafters, wants, shared):
        rows_per_pass.append(len(wants))
        return real(drafters, wants, shared)
    monkeypatch.setattr(CausalWindowDrafter, "draft_rows", staticmethod(recording))
    for policy in POLICIES:
        _check_batches(SpeculativeEngine(target, make_drafter(target, drafter, denoise="causal"), policy), _requests())
    assert max(rows_per_pass) == len(LENGTHS) - 1  # every row but the one-token one (it never drafts)


def test_dflash_rows_run_their_passes_together(random_models, monkeypatch):
    """DFlash rows at different context lengths run their first and extension passes in one
    forward and draft what each drafts alone (`_check_batches`)."""
    from failfast.model.dflash import DFlashModel

    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["random-dflash"], dtype=torch.float64)
    forwards = []  # (rows, widest block) of each batched pass
    real = DFlashModel.draft_passes

    def recording(self, windows, rows, starts, cache):
        forwards.append((len(windows), max(map(len, windows))))
        return real(self, windows, rows, starts, cache)
    monkeypatch.setattr(DFlashModel, "draft_passes", recording)
    engine = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(tau=0.0, chunk=3, max_draft=20))
    _check_batches(engine, _requests())
    block = drafter.config.block_size
    assert max(rows for rows, _ in forwards) == len(LENGTHS) - 1  # every row but the one with no draft budget
    assert any(rows > 1 and width > block for rows, width in forwards)  # extension passes together


def test_eagle3_rows_step_together(random_models, monkeypatch):
    """EAGLE-3 rows at different cache lengths advance their chains in one forward and draft
    what each drafts alone (`_check_batches`)."""
    from failfast.model.eagle3 import Eagle3Model

    target = load_model(random_models["target"], dtype=torch.float64)
    drafter = load_model(random_models["random-eagle3"], dtype=torch.float64)
    rows_per_step = []
    real = Eagle3Model.step_rows

    def recording(self, tokens, hidden, rows, starts, cache):
        rows_per_step.append(len(set(starts)) if len(rows) > 1 else 0)
        return real(self, tokens, hidden, rows, starts, cache)
    monkeypatch.setattr(Eagle3Model, "step_rows", recording)
    engine = SpeculativeEngine(target, make_drafter(target, drafter), FailFast(tau=0.0, chunk=3, max_draft=20))
    _check_batches(engine, _requests())
    assert max(rows_per_step) >= 3  # rows at three or more different positions in one step


def test_ragged_forward_equals_one_row_forwards(random_models):
    """A packed forward over some rows of a batch cache gives each row the logits and K/V of
    its own one-row forward: causal, and block-causal up to per-row context ends (float64)."""
    model = load_model(random_models["random-dllm"], dtype=torch.float64).model
    gen = torch.Generator().manual_seed(0)
    prefixes = [torch.randint(2, 90, (1, n), generator=gen) for n in (5, 16, 9)]
    new = [torch.randint(2, 90, (1, n), generator=gen) for n in (3, 1, 6)]
    for block_size, context_ends in ((None, None), (8, [8, 24, 16])):
        batch, alone = model.new_cache(40, batch=4), []
        for row, prefix in zip((0, 2, 3), prefixes):
            model(prefix, 0, batch.row(row), block_size=block_size)
            alone.append(model.new_cache(40))
            model(prefix, 0, alone[-1], block_size=block_size)
        ragged = Ragged.pack([0, 2, 3], [p.shape[1] for p in prefixes], [t[0].tolist() for t in new], model.device)
        packed = model.forward_ragged(ragged, batch, block_size=block_size, context_ends=context_ends)
        assert packed.shape[0] == sum(t.shape[1] for t in new)  # no padding reaches the head
        for i, (row, prefix, tokens, cache) in enumerate(zip((0, 2, 3), prefixes, new, alone)):
            ctx = None if context_ends is None else context_ends[i]
            one = model(tokens, prefix.shape[1], cache, block_size=block_size, commit=ctx is None, context_end=ctx)[0]
            lo = ragged.offsets[i]
            assert torch.allclose(packed[lo:lo + tokens.shape[1]], one, atol=1e-12)
            end = prefix.shape[1] + tokens.shape[1]
            assert torch.allclose(batch.keys[1][row, :, :end], cache.keys[1][0, :, :end], atol=1e-12)


def test_shape_buckets():
    from failfast.model.shapes import key_bucket, token_bucket

    assert [token_bucket(n) for n in (1, 3, 5, 8, 9, 64, 65, 1024, 1025)] == [1, 4, 8, 8, 16, 64, 128, 1024, 1280]
    assert [key_bucket(n, 300) for n in (1, 64, 65, 200, 257, 300)] == [64, 64, 128, 256, 300, 300]
    assert len({token_bucket(n) for n in range(1, 4097)}) == 38
    with pytest.raises(ValueError):
        key_bucket(301, 300)


def test_padded_ragged_forward_fills_a_bucket_in_the_padding_row(random_models):
    """Filler tokens pad the packed forward to its bucket in the padding row only (split into
    rows no wider than the widest real row or the capacity); the real rows' logits and K/V
    are those of the unpadded forward (float64; other GEMM shapes, so up to rounding)."""
    model = load_model(random_models["target"], dtype=torch.float64).model
    gen = torch.Generator().manual_seed(1)
    new = [torch.randint(2, 90, (n,), generator=gen).tolist() for n in (30, 23, 20)]  # 73 tokens -> 128
    plain, padded = model.new_cache(48, batch=4), model.new_cache(48, batch=4)
    ragged = Ragged.pack([0, 1, 2], [0, 0, 0], new, model.device)
    filled = Ragged.pack([0, 1, 2], [0, 0, 0], new, model.device, padding_row=3, capacity=48)
    assert filled.tokens.shape[1] == 128 and filled.rows == [0, 1, 2, 3, 3] and filled.lengths[3:] == [30, 25]
    assert filled.width == 32  # the widest real row's bucket: filler rows are no wider
    narrow = Ragged.pack([0, 1, 2], [0, 0, 0], new, model.device, padding_row=3, capacity=16)
    assert narrow.lengths[3:] == [16, 16, 16, 7]  # no filler row past the capacity
    want = model.forward_ragged(ragged, plain)
    got = model.forward_ragged(filled, padded)
    assert torch.allclose(got[:73], want, atol=1e-12)
    for layer in range(len(plain.keys)):
        assert torch.allclose(padded.keys[layer][:3], plain.keys[layer][:3], atol=1e-12)
    with pytest.raises(ValueError, match="causal"):
        model.forward_ragged(filled, padded, block_size=8, context_ends=[40, 40, 40, 40, 40])


@pytest.mark.parametrize("drafter_name", [None, "random-dllm", "random-dflash"])
def test_bucketed_shapes_keep_every_row(random_models, monkeypatch, drafter_name):
    """With bucketed shapes every verification is one packed forward (one row too) whose
    tokens, attention width and keys read come from the buckets, and every row's output and
    drafts stay what the unpadded engine gives (`_check_batches`, float64)."""
    from failfast.model.kv_cache import KVCache
    from failfast.model.shapes import key_bucket, token_bucket

    target = load_model(random_models["target"], dtype=torch.float64)
    shapes = []  # (tokens, width, keys read, capacity) of each causal ragged forward's first layer
    real = KVCache.write_ragged

    def recording(self, layer, ragged, k, v, read_end):
        if layer == 0 and ragged.bucketed:
            shapes.append((ragged.tokens.shape[1], ragged.width, read_end, self.capacity))
        return real(self, layer, ragged, k, v, read_end)
    monkeypatch.setattr(KVCache, "write_ragged", recording)
    if drafter_name is None:
        engine = SpeculativeEngine(target, bucketed_shapes=True)
    else:
        drafter = make_drafter(target, load_model(random_models[drafter_name], dtype=torch.float64))
        engine = SpeculativeEngine(target, drafter, FailFast(tau=0.0, chunk=3, max_draft=20), bucketed_shapes=True)
    reference = SpeculativeEngine(target, engine.drafter, engine.policy)
    requests = _requests()
    want = [reference.generate(r.prompt_ids, r.max_new_tokens, r.sampling, r.stop) for r in requests]
    for batch_size in (1, 3, len(requests)):
        got = dict(engine.generate_many(requests, batch_size))
        for i, w in enumerate(want):
            assert got[i].token_ids == w.token_ids
            assert [(x.drafted, x.accepted) for x in got[i].stats.trajectory] == \
                   [(x.drafted, x.accepted) for x in w.stats.trajectory]
    assert shapes and all(n == token_bucket(n) and w == token_bucket(w) and keys == key_bucket(keys, cap)
                          for n, w, keys, cap in shapes)
    assert len({n for n, *_ in shapes}) < len(shapes) / 4  # few shapes for many rounds


def test_the_batch_throughput_script_runs_every_kind_of_engine():
    """scripts/batch_throughput.py as a user runs it (smoke size): gated and bucketed copies of
    the FailFast engines, every row identical to its B = 1 run and to plain AR."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "batch_throughput.py"
    proc = subprocess.run([sys.executable, str(script), "--prompts", "2", "--max-new-tokens", "6", "--batch-sizes", "1,2",
                           "--repeats", "1", "--gated", "--bucketed",
                           "--methods", "failfast+gate,failfast-dflash+buckets,failfast-eagle3,failfast-lookup"],
                          capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and "x |" in line]
    assert {r[1].strip() for r in rows} == {"ar", "failfast+gate", "failfast-dflash+buckets", "failfast-eagle3",
                                            "failfast-lookup"}
    assert len(rows) == 10 and all(r[-3].strip() == r[-2].strip() == "0" for r in rows)  # no row differs
