"""`failfast batch` as a user runs it: row-by-row exactness, bad lines, kill -9 and resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from failfast import SamplingParams, SpeculativeEngine, load_model
from failfast.batch_job import errors_path
from failfast.cli import main
from failfast.jsonl_results import JsonlResults
from tests.helpers import prompt_of

FLAGS = ["--dtype", "float64", "--policy", "failfast", "--chunk", "3", "--max-draft", "9"]


def _write_rows(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _without_stats(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "stats"} for r in rows]


def test_rows_equal_single_generation_and_bad_lines_are_reported(random_models, tmp_path):
    target_dir, drafter_dir = random_models["target"], random_models["random-dllm"]
    rows = [
        {"id": "first", "prompt_ids": prompt_of(5), "max_new_tokens": 20},
        "this is not json",
        {"id": "sampled", "prompt_ids": prompt_of(9), "temperature": 0.8, "seed": 3},
        {"id": "no-prompt"},
        {"id": "first", "prompt_ids": [4]},  # duplicate id
        {"prompt_ids": prompt_of(12), "max_new_tokens": 250},  # too long for the 256-token context
        {"prompt_ids": prompt_of(7), "top_k": 5, "temperature": 1.0},  # id: its line number, 7
        {"id": "penalized", "prompt_ids": prompt_of(3), "repetition_penalty": 3.0, "frequency_penalty": 0.5},
    ]
    out = tmp_path / "results.jsonl"
    code = main(["batch", "--input", str(_write_rows(tmp_path / "in.jsonl", rows)), "--output", str(out),
                 "--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "16", *FLAGS])
    assert code == 1  # some rows failed; the others ran
    got = {r["id"]: r for r in _read(out)}  # rows land in the order they finish
    target = load_model(target_dir, dtype=torch.float64)
    plain = SpeculativeEngine(target)
    expected = {"first": plain.generate(prompt_of(5), 20), "sampled": plain.generate(prompt_of(9), 16, SamplingParams(0.8, seed=3)),
                7: plain.generate(prompt_of(7), 16, SamplingParams(1.0, top_k=5)),
                "penalized": plain.generate(prompt_of(3), 16, SamplingParams(repetition_penalty=3.0, frequency_penalty=0.5))}
    assert set(got) == set(expected)
    for row_id, want in expected.items():
        row = got[row_id]
        assert row["token_ids"] == want.token_ids and row["stop_reason"] == want.stop_reason
        assert row["stats"]["tokens"] == len(want.token_ids)
    errors = _read(errors_path(out))
    assert [(e["line"], e["id"]) for e in errors] == [(2, None), (4, "no-prompt"), (5, "first"), (6, 6)]
    reasons = " | ".join(e["error"] for e in errors)
    for needed in ("not JSON", '"prompt"', "duplicate id", "exceeds the target's context"):
        assert needed in reasons


def test_text_prompts_and_stop_strings(tmp_path):
    """With the embedded tokenizer: a row's stop string cuts its text exactly as generate does."""
    out = tmp_path / "r.jsonl"
    prompt = "def add(a, b):\n"
    code = main(["batch", "--input", str(_write_rows(tmp_path / "in.jsonl", [{"prompt": prompt, "stop": ["\n\n"]}])),
                 "--output", str(out), "--policy", "ar", "--max-new-tokens", "40", "--dtype", "float64"])
    assert code == 0
    [row] = _read(out)
    target = load_model(Path(__file__).parents[1] / "src/failfast/models/target", dtype=torch.float64)
    want = SpeculativeEngine(target).generate(target.tokenizer.encode(prompt), 40, stop=["\n\n"])
    assert row["text"] == want.text and row["token_ids"] == want.token_ids and row["stop_reason"] == want.stop_reason


def test_torn_last_line_is_cut_and_rewritten(tmp_path):
    path = tmp_path / "r.jsonl"
    with JsonlResults(path) as results:
        results.write({"id": 1, "x": "a"})
    with open(path, "ab") as f:
        f.write(b'{"id": 2, "x": "tor')  # a crash in the middle of a write
    reopened = JsonlResults(path)
    assert reopened.done == {1} and reopened.repaired_bytes == len(b'{"id": 2, "x": "tor')
    reopened.write({"id": 2, "x": "whole"})
    reopened.close()
    assert _read(path) == [{"id": 1, "x": "a"}, {"id": 2, "x": "whole"}]


def test_sigkill_mid_run_then_resume_gives_the_uninterrupted_file(random_models, tmp_path):
    target_dir, drafter_dir = random_models["target"], random_models["random-dllm"]
    rows = [{"id": f"r{i}", "prompt_ids": prompt_of(4 + i % 9, seed=i), "max_new_tokens": 120} for i in range(60)]
    inp = _write_rows(tmp_path / "in.jsonl", rows)
    args = ["batch", "--input", str(inp), "--target", str(target_dir), "--drafter", str(drafter_dir), *FLAGS,
            "--batch-size", "4"]
    reference = tmp_path / "reference.jsonl"
    assert main([*args, "--output", str(reference)]) == 0

    out = tmp_path / "killed.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "failfast.cli", *args, "--output", str(out)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if out.is_file() and out.read_bytes().count(b"\n") >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = out.read_bytes().count(b"\n")
    assert 3 <= written < len(rows), "the job must be killed mid-way for this test to mean anything"
    assert main([*args, "--output", str(out)]) == 0  # resume
    got = _read(out)
    assert len({r["id"] for r in got}) == len(got) == len(rows)
    by_id = lambda rs: sorted(_without_stats(rs), key=lambda r: r["id"])  # noqa: E731 (rows land as they finish)
    assert by_id(got) == by_id(_read(reference))
