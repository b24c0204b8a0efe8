"""Metrics as JSON lines beside the checkpoints: one object per logged step or evaluation.

Only rank 0 writes. On resume the file is cut back to the resumed step, so the records of steps
that are about to be redone disappear and the file reads as one uninterrupted run.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings so every line stays valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _clean(value.item())
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics file, skipping a torn last line (a crash mid-write)."""
    path = Path(path)
    records = []
    if not path.is_file():
        return records
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class MetricsWriter:
    """Appends records to `path`; a no-op on ranks other than the main one."""

    def __init__(self, path: str | Path, *, enabled: bool = True, resume_step: int | None = None):
        self.path = Path(path)
        self.enabled = enabled
        self._file = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.write_text("")  # a fresh run starts a fresh file
        else:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(self.path.suffix + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._file = self.path.open("a", buffering=1)  # line-buffered: a crash loses at most one line

    def log(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(_clean(record)) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
