"""The hang watchdog names the rank that is missing from a collective, the collective and the
step, on every rank (the end-to-end hang + elastic restart is in test_fault_elastic.py)."""
from __future__ import annotations

import time

import pytest

from phalanx.testing import spawn


def rank_quiet_then_one_sleeps(sleep_s: float, timeout_s: float):
    """First 20 slow steps where no single operation is overdue (no report expected), then rank 1
    sleeps inside 'forward' while rank 0 waits in the all-reduce."""
    import torch
    import torch.distributed as dist

    from phalanx.watchdog import Watchdog, set_step, track

    quiet = []
    dog = Watchdog(timeout_s, interval_s=0.2, on_hang=quiet.append).start()
    try:
        for _ in range(20):
            with track("all-reduce"):
                dist.all_reduce(torch.ones(1))
            time.sleep(0.05)
    finally:
        dog.stop()

    reports = []
    dog = Watchdog(timeout_s, interval_s=0.25, on_hang=reports.append).start()
    try:
        set_step(7)
        with track("forward"):
            if dist.get_rank() == 1:
                time.sleep(sleep_s)  # the straggler
        with track("loss all-reduce"):
            dist.all_reduce(torch.ones(1))
        time.sleep(0.6)  # let the watchdog threads finish reporting
    finally:
        dog.stop()
    return quiet, reports


def test_watchdog_is_quiet_then_names_the_missing_rank_on_every_rank():
    results = spawn(rank_quiet_then_one_sleeps, 2, 3.0, 1.0, timeout=120)
    assert [quiet for quiet, _ in results] == [[], []]
    reports = [r for _, r in results]
    assert all(len(r) == 1 for r in reports), reports
    waiting, straggler = reports[0][0], reports[1][0]
    assert "on rank 0: 'loss all-reduce' at step 7 has not finished" in waiting
    assert "Missing from it: rank 1" in waiting
    assert "rank 1: last entered 'forward' at step 7 (inside" in waiting
    assert "on rank 1: 'forward' at step 7" in straggler and "This rank is behind: rank 0" in straggler


def test_watchdog_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="positive"):
        from phalanx.watchdog import Watchdog
        Watchdog(0)
