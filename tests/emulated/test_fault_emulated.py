"""Fault recovery once on the emulated GPU: a rank SIGKILLed mid-step under `phalanx run
--max-restarts`, the job exits 0 and ends with the uninterrupted run's weights bit for bit (the
existing test, in a child pytest with PHALANX_EMULATE_GPU=1)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402


@pytest.mark.slow
def test_a_killed_rank_recovers_on_the_emulated_gpu():
    out = pytest_emulated("tests/framework/test_fault_elastic.py::"
                          "test_rank_killed_mid_step_restarts_and_matches_uninterrupted_run")
    assert "1 passed" in out, out[-3000:]
