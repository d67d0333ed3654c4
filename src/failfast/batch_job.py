"""`failfast batch`: a JSONL file of prompts in, one JSON line per prompt out, resumable.

Rows decode `batch_size` at a time (the engine's `generate_many`) and are written as they
finish (durably, `jsonl_results.py`); rerunning with the same output skips the ids already
there, so a killed job loses at most the rows in flight. Input lines
that cannot run (not JSON, no prompt, too long for the context) go to `<output
stem>.errors.jsonl` with their line number and reason, and the job goes on.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from failfast.decode.engine import GenerationRequest
from failfast.errors import FailfastError, GenerationInputError
from failfast.jsonl_results import JsonlResults
from failfast.pipeline import Pipeline
from failfast.progress import log_milestone
from failfast.decode.sampling import SamplingParams

# Per-row fields that override the job's generation flags.
ROW_OVERRIDES = {"max_new_tokens": int, "temperature": float, "top_k": int, "top_p": float, "seed": int,
                 "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float}


@dataclass(frozen=True)
class RowDefaults:
    """The job's generation flags; a row may override any of `ROW_OVERRIDES` and `stop`."""

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class BatchRow:
    line: int  # 1-based line number in the input file
    id: Any
    prompt: str | list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]


@dataclass
class BatchSummary:
    rows: int = 0          # valid input rows
    skipped: int = 0       # already in the output file when the job started
    generated: int = 0
    failed: int = 0        # input lines or rows that could not run
    tokens: int = 0
    wall_s: float = 0.0
    repaired_bytes: int = 0  # torn tail of the output file cut off on resuming


def errors_path(output: Path) -> Path:
    """results.jsonl -> results.errors.jsonl"""
    return output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")


def _parse_row(line_no: int, raw: bytes, defaults: RowDefaults) -> BatchRow:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise GenerationInputError(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise GenerationInputError("a row must be a JSON object")
    has_text, has_ids = "prompt" in obj, "prompt_ids" in obj
    if has_text == has_ids:
        raise GenerationInputError('a row needs exactly one of "prompt" (text) or "prompt_ids" (token ids)')
    prompt = obj["prompt"] if has_text else obj["prompt_ids"]
    if has_text and not isinstance(prompt, str):
        raise GenerationInputError('"prompt" must be a string')
    if has_ids and not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        raise GenerationInputError('"prompt_ids" must be a list of integers')
    values: dict[str, Any] = {"max_new_tokens": defaults.max_new_tokens, **vars(defaults.sampling)}
    for key, kind in ROW_OVERRIDES.items():
        if key in obj:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
                raise GenerationInputError(f'"{key}" must be {"an integer" if kind is int else "a number"}')
            values[key] = value
    stop = obj.get("stop", list(defaults.stop))
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise GenerationInputError('"stop" must be a string or a list of strings')
    row_id = obj.get("id", line_no)
    if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
        raise GenerationInputError('"id" must be a string or an integer')
    max_new = values.pop("max_new_tokens")
    return BatchRow(line_no, row_id, prompt, max_new, replace(defaults.sampling, **values), tuple(stop))


def _id_of(raw: bytes) -> Any:
    """A bad line's id if it has a usable one (for the error report), else None."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    row_id = obj.get("id") if isinstance(obj, dict) else None
    return row_id if isinstance(row_id, (str, int)) and not isinstance(row_id, bool) else None


def read_rows(path: Path, defaults: RowDefaults) -> Iterator[BatchRow | tuple[int, Any, str]]:
    """Each non-blank input line as a `BatchRow`, or (line, id or None, reason) when it is bad."""
    seen: set[Any] = set()
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = _parse_row(line_no, raw, defaults)
            except GenerationInputError as exc:
                yield line_no, _id_of(raw), str(exc)
                continue
            if row.id in seen:
                yield line_no, row.id, f"duplicate id {row.id!r}"
                continue
            seen.add(row.id)
            yield row


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("[bold]batch"), BarColumn(), MofNCompleteColumn(), TextColumn("rows"),
                    TextColumn("{task.fields[tps]:.1f} tok/s"), TextColumn("{task.fields[failed]} failed"),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console)


def run_batch(pipe: Pipeline, input_path: Path, output_path: Path, defaults: RowDefaults,
              batch_size: int = 1, console: Console | None = None) -> BatchSummary:
    """Generate every row of `input_path` not already in `output_path`, `batch_size` rows per
    target forward; rows are written in the order they finish."""
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise GenerationInputError(f"input file {input_path} does not exist")
    if batch_size < 1:
        raise GenerationInputError(f"batch size must be >= 1, got {batch_size}")
    console = console or Console(stderr=True)
    summary = BatchSummary()
    entries = list(read_rows(input_path, defaults))
    rows = [e for e in entries if isinstance(e, BatchRow)]
    summary.rows = len(rows)
    started = time.perf_counter()
    with JsonlResults(output_path) as results, JsonlResults(errors_path(output_path), resume=False) as errors:
        summary.repaired_bytes = results.repaired_bytes

        def fail(line: int, row_id: Any, reason: str) -> None:
            errors.write({"line": line, "id": row_id, "error": reason})
            summary.failed += 1

        for line_no, row_id, reason in (e for e in entries if not isinstance(e, BatchRow)):
            fail(line_no, row_id, reason)
        todo = [r for r in rows if r.id not in results.done]
        summary.skipped = len(rows) - len(todo)
        runnable: list[tuple[BatchRow, GenerationRequest]] = []
        for row in todo:
            try:
                ids = pipe.encode(row.prompt) if isinstance(row.prompt, str) else list(row.prompt)
                request = GenerationRequest(ids, row.max_new_tokens, row.sampling, row.stop)
                pipe.engine.check_request(request)
            except FailfastError as exc:
                fail(row.line, row.id, str(exc))
            else:
                runnable.append((row, request))
        with _progress(console) as bar:
            task = bar.add_task("batch", total=len(runnable), tps=0.0, failed=summary.failed)
            finished = pipe.engine.generate_many([r for _, r in runnable], batch_size)
            for done, (index, result) in enumerate(finished, start=1):
                results.write({"id": runnable[index][0].id, "text": result.text, "token_ids": result.token_ids,
                               "stop_reason": result.stop_reason, "stats": result.stats.to_dict()})
                summary.generated += 1
                summary.tokens += len(result.token_ids)
                elapsed = time.perf_counter() - started
                bar.update(task, advance=1, tps=summary.tokens / elapsed, failed=summary.failed)
                log_milestone(bar, done, len(runnable), started, f"rows: {summary.tokens / elapsed:.1f} tok/s, "
                              f"{summary.failed} failed")
    summary.wall_s = time.perf_counter() - started
    return summary


def print_summary(summary: BatchSummary, output: Path, file=sys.stderr) -> None:
    parts = [f"{summary.generated} rows generated ({summary.tokens} tokens in {summary.wall_s:.1f}s)"]
    if summary.skipped:
        parts.append(f"{summary.skipped} already done")
    if summary.repaired_bytes:
        parts.append(f"a torn last line ({summary.repaired_bytes} bytes) rewritten")
    if summary.failed:
        parts.append(f"{summary.failed} failed (see {errors_path(output)})")
    print("; ".join(parts) + f" -> {output}", file=file)
