"""The planner's measured-memory tests: each case's estimate against the worst rank's measured peak."""
from __future__ import annotations

from typing import Callable


def estimate_errors(model: dict, cases: dict, ranks: list, world: int, check: Callable | None = None) -> dict:
    """{case: estimate / measured - 1} for `cases` ({name: (make_plugin kwargs, seq, micro batch)}) of
    `model` measured on `world` ranks (`ranks`: each rank's `measure_many` results, in case order).
    Every case must have trained (3 losses, the last below the first); `check(name, estimate)` may
    assert more. Prints both sides in MiB and the phase the estimate's peak falls in."""
    from phalanx.booster.plugins import make_plugin
    from phalanx.plan import estimate_for_run

    errors, mib = {}, {}
    for i, (name, (kwargs, seq, mb)) in enumerate(cases.items()):
        kwargs = dict(kwargs)
        lora = kwargs.pop("lora", None)
        plugin = make_plugin(kwargs.pop("name"), precision="fp32", **kwargs)
        est = estimate_for_run(dict(model), plugin, seq, mb, world, loss="hf", lora=lora)
        if check is not None:
            check(name, est)
        measured = max(r[i]["anon"] for r in ranks)
        errors[name] = round(est.memory.device_total / measured - 1, 4)
        mib[name] = (round(est.memory.device_total / 2**20, 1), round(measured / 2**20, 1), est.memory.phase)
        first = ranks[0][i]["losses"]
        assert len(first) == 3 and first[-1] < first[0], (name, first)  # training ran and learned
    print("\n  estimate / measured - 1:", errors, "\n  MiB (estimate, measured, peak in):", mib)
    return errors
