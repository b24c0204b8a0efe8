"""One result per check, the table printed at the end, and the JSON written beside it."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

PASS, FAIL, SKIP = "pass", "FAIL", "skip"


@dataclass
class Result:
    group: str
    name: str
    status: str
    detail: str = ""
    figures: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0


def run_check(group: str, name: str, fn: Callable[[], "tuple[str, dict] | str | None"]) -> Result:
    """Run one check: it returns a detail string (and figures), raises AssertionError to fail, or
    raises `Skip` to say why it cannot run here."""
    start = time.perf_counter()
    try:
        out = fn()
        detail, figures = (out if isinstance(out, tuple) else (out or "", {}))
        status = PASS
    except Skip as why:
        status, detail, figures = SKIP, str(why), {}
    except Exception as exc:  # noqa: BLE001 - every failure is reported, the others still run
        status, detail, figures = FAIL, f"{type(exc).__name__}: {exc}".splitlines()[0][:300], {}
    return Result(group, name, status, detail, figures, time.perf_counter() - start)


class Skip(Exception):
    """Raised by a check that cannot run on this machine (the reason is printed)."""


def table(results: list[Result]) -> str:
    rows = [("group", "check", "result", "time", "detail")]
    for r in results:
        rows.append((r.group, r.name, r.status, f"{r.seconds:.1f}s", r.detail))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4])
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    lines.append(f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped")
    return "\n".join(lines)


def write_json(results: list[Result], path: Path, header: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({**header, "results": [asdict(r) for r in results]}, indent=1))
    tmp.replace(path)
