"""An append-only JSON Lines file that survives `kill -9`: every line is written whole,
flushed and fsynced before the next row starts, and reopening it finds the ids already done
and cuts off a torn last line (a crash mid-write) so it can be written again."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _intact_prefix(data: bytes) -> tuple[int, list[dict[str, Any]]]:
    """Byte length of the leading complete, parseable lines, and those lines' objects."""
    end, rows = 0, []
    while (newline := data.find(b"\n", end)) != -1:
        try:
            row = json.loads(data[end:newline])
        except ValueError:
            break
        if not isinstance(row, dict):
            break
        rows.append(row)
        end = newline + 1
    return end, rows


class JsonlResults:
    """Rows keyed by `id`; `done` holds the ids already in the file when it was opened."""

    def __init__(self, path: Path, *, resume: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: set[Any] = set()
        self.repaired_bytes = 0  # bytes of a torn tail cut off on opening
        if resume and self.path.is_file():
            data = self.path.read_bytes()
            keep, rows = _intact_prefix(data)
            self.done = {row.get("id") for row in rows}
            self.repaired_bytes = len(data) - keep
            if self.repaired_bytes:
                with open(self.path, "r+b") as f:
                    f.truncate(keep)
                    os.fsync(f.fileno())
        self._file = open(self.path, "ab" if resume else "wb")

    def write(self, row: dict[str, Any]) -> None:
        """Append one row durably (it is on disk when this returns)."""
        self._file.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self.done.add(row.get("id"))

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "JsonlResults":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
