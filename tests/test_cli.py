"""`failfast generate` end to end, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from failfast import FailFast, SamplingParams, SpeculativeEngine, drafter_failfast, load_model, make_drafter
from failfast.cli import _load_pipeline, _policy, build_parser, main
from failfast.drafters.lookup import LookupDrafter


def test_generate_json_matches_the_library(target_dir, capsys):
    code = main(["generate", "--target", str(target_dir), "--drafter", str(target_dir), "--policy", "failfast",
                 "--chunk", "3", "--max-draft", "9", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "12",
                 "--dtype", "float64", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    target = load_model(target_dir, dtype=torch.float64)
    engine = SpeculativeEngine(target, make_drafter(target, target), FailFast(chunk=3, max_draft=9))
    expected = engine.generate([5, 6, 7, 8], 12)
    assert out["token_ids"] == expected.token_ids and out["text"] is None
    for key in ("tokens", "rounds", "drafted", "accepted", "drafter_forwards", "target_forwards",
                "wall_s", "draft_s", "verify_s"):
        assert key in out["stats"]
    assert out["stats"]["tokens"] == len(out["token_ids"])
    assert out["stats"]["accepted"] == out["stats"]["drafted"]  # self-drafting accepts everything


def test_penalty_flags_reach_the_sampler(random_models, capsys):
    target_dir = random_models["target"]
    code = main(["generate", "--target", str(target_dir), "--drafter", str(random_models["random-dllm"]),
                 "--prompt-ids", "5,6,7", "--max-new-tokens", "16", "--dtype", "float64", "--json",
                 "--repetition-penalty", "3", "--presence-penalty", "0.5", "--frequency-penalty", "0.25"])
    assert code == 0
    target = load_model(target_dir, dtype=torch.float64)
    want = SpeculativeEngine(target).generate([5, 6, 7], 16, SamplingParams(repetition_penalty=3.0, presence_penalty=0.5,
                                                                            frequency_penalty=0.25))
    assert json.loads(capsys.readouterr().out)["token_ids"] == want.token_ids
    assert want.token_ids != SpeculativeEngine(target).generate([5, 6, 7], 16).token_ids


def test_cost_aware_policy_from_the_cli_is_lossless(random_models, capsys):
    target_dir, drafter_dir = random_models["target"], random_models["random-dllm"]
    code = main(["generate", "--target", str(target_dir), "--drafter", str(drafter_dir), "--policy", "cost-aware",
                 "--chunk", "4", "--max-draft", "16", "--prompt-ids", "5,6,7,8,9", "--max-new-tokens", "20",
                 "--dtype", "float64", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    plain = SpeculativeEngine(load_model(target_dir, dtype=torch.float64)).generate([5, 6, 7, 8, 9], 20)
    # the policy drafted (how much of it is verified depends on the costs measured on this machine)
    assert out["token_ids"] == plain.token_ids and out["stats"]["drafter_forwards"] > 0


def test_console_script_runs_plain_ar(target_dir):
    proc = subprocess.run([sys.executable, "-m", "failfast.cli", "generate", "--target", str(target_dir),
                           "--policy", "ar", "--prompt-ids", "5,6,7", "--max-new-tokens", "4"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "target rounds" in proc.stderr and proc.stdout.strip()


def test_the_speculation_gate_is_on_for_many_rows_and_off_for_one_prompt():
    parser = build_parser()
    batch = ["batch", "--input", "in.jsonl", "--output", "out.jsonl"]
    assert parser.parse_args(batch).speculation_gate and parser.parse_args(["serve"]).speculation_gate
    assert not parser.parse_args([*batch, "--no-speculation-gate"]).speculation_gate
    assert not parser.parse_args(["generate", "--prompt", "x"]).speculation_gate
    assert parser.parse_args(["generate", "--prompt", "x", "--speculation-gate"]).speculation_gate


@pytest.mark.parametrize("kind", ["random-dllm", "random-dflash", "random-eagle3", "random-ar"])
def test_failfast_defaults_follow_the_drafter_kind(random_models, kind):
    """`--tau` / `--chunk` left out: the drafter kind's measured settings; given: as given."""
    target = load_model(random_models["target"], dtype=torch.float64)
    loaded = load_model(random_models[kind], dtype=torch.float64)
    drafter = make_drafter(target, loaded)
    cfg = loaded.config
    expected = {"random-dllm": lambda: (0.6, min(4, cfg.sub_block_size)),  # the likely head of a pass's sub-block
                "random-dflash": lambda: (0.8, min(6, cfg.block_size - 1)),  # the likely head of a block
                "random-eagle3": lambda: (0.8, 2),                           # a chain stops at the first unsure pair
                "random-ar": lambda: (0.45, 8)}[kind]()
    assert drafter_failfast()(target, drafter, [5, 6]) == FailFast(*expected)
    assert drafter_failfast(tau=0.2, chunk=3, max_draft=9)(target, drafter, [5, 6]) == FailFast(0.2, 3, 9)
    assert drafter_failfast(max_draft=1)(target, drafter, [5, 6]) == FailFast(expected[0], 1, 1)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--drafter", str(random_models[kind])])
    assert _policy(args)(target, drafter, [5, 6]) == FailFast(*expected)


def test_prompt_lookup_is_on_in_front_of_a_drafter_unless_turned_off(random_models):
    target, dllm = str(random_models["target"]), str(random_models["random-dllm"])

    def drafter_of(*flags: str):
        args = build_parser().parse_args(["generate", "--target", target, *flags, "--prompt", "x", "--dtype", "float64"])
        return _load_pipeline(args).engine.drafter
    assert isinstance(drafter_of("--drafter", dllm), LookupDrafter)
    assert isinstance(drafter_of("--drafter", dllm, "--policy", "fixed"), LookupDrafter)
    assert not isinstance(drafter_of("--drafter", dllm, "--no-lookup"), LookupDrafter)
    assert drafter_of() is None  # a target of one's own without a drafter decodes plainly
    assert drafter_of("--lookup").inner is None  # unless asked for prompt lookup alone


@pytest.mark.parametrize("with_drafter", [True, False])
def test_lookup_from_the_cli_copies_and_stays_lossless(random_models, capsys, with_drafter):
    """--lookup in front of a drafter, or alone on a target without one: the target's tokens,
    and drafts where the prompt repeats itself."""
    target_dir = random_models["target"]
    prompt = [5, 6, 7, 8, 9] * 4
    drafter = ["--drafter", str(random_models["random-dllm"])] if with_drafter else []
    code = main(["generate", "--target", str(target_dir), *drafter, "--lookup", "--lookup-tokens", "5",
                 "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "20", "--dtype", "float64", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    plain = SpeculativeEngine(load_model(target_dir, dtype=torch.float64)).generate(prompt, 20)
    assert out["token_ids"] == plain.token_ids
    assert out["stats"]["drafted"] > 0
    if not with_drafter:
        assert out["stats"]["drafter_forwards"] == 0  # copies only
