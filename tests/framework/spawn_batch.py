"""Several rank bodies in one spawn, for the tests of a file that use the same number of ranks.

Every `phalanx.testing.spawn` starts fresh interpreters that import torch, transformers and
phalanx and meet over gloo: seconds per rank before any test code runs, several times over on a
2-core CI machine. A module-scoped fixture calls `spawn_suites` once with the suites of the tests
that were selected (`-k` still runs only what it picks), and each test reads its own result with
`SuiteResults.get`, which fails that test alone with the suite's traceback.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable

from phalanx.testing import spawn


def run_suites(suites: dict[str, tuple[Callable, tuple, dict]]) -> dict[str, tuple[str, Any]]:
    """Rank body: run each suite in turn, returning ("ok", value) or ("error", traceback) by name.
    After a failure the remaining suites are not run: the ranks may be out of step."""
    results: dict[str, tuple[str, Any]] = {}
    failed = None
    for name, (fn, args, kwargs) in suites.items():
        if failed is not None:
            results[name] = ("error", f"not run: the suite {failed!r} failed before it in the same spawn")
            continue
        try:
            results[name] = ("ok", fn(*args, **kwargs))
        except Exception:  # noqa: BLE001 - reported by the test that owns the suite
            results[name] = ("error", traceback.format_exc())
            failed = name
    return results


class SuiteResults:
    """The per-rank results of one `spawn_suites` call."""

    def __init__(self, per_rank: list[dict[str, tuple[str, Any]]]):
        self.per_rank = per_rank

    def get(self, name: str) -> list[Any]:
        """The suite's return value on every rank (rank order); fails if any rank raised."""
        import pytest

        errors = [f"rank {rank}:\n{r[name][1]}" for rank, r in enumerate(self.per_rank)
                  if name not in r or r[name][0] != "ok"]
        if errors:
            pytest.fail(f"suite {name!r} failed\n" + "\n".join(errors), pytrace=False)
        return [r[name][1] for r in self.per_rank]


def selected_tests(request) -> set[str]:
    """Names of the tests of the requesting module that this session runs: each with its
    parameters (`test_x[2-ddp]`) and without (`test_x`)."""
    items = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    return {item.name for item in items} | {getattr(item, "originalname", item.name) for item in items}


def spawn_suites(request, world_size: int, suites: dict[str, tuple[Callable, tuple, dict]],
                 timeout: float, **spawn_kwargs: Any) -> SuiteResults:
    """Spawn `world_size` ranks once for the suites whose test is selected. A suite's name is its
    test's name (with its parameters for one case of a parametrized test), optionally followed by
    ":part" when a test needs more than one suite."""
    chosen = selected_tests(request)
    todo = {name: suite for name, suite in suites.items() if name.split(":")[0] in chosen}
    if not todo:
        return SuiteResults([{} for _ in range(world_size)])
    return SuiteResults(spawn(run_suites, world_size, todo, timeout=timeout, **spawn_kwargs))
