"""Hybrid parallelism's equivalence with one process on the emulated GPU (NCCL path, device
tensors, device checks): tensor, sequence (split-gather, Ulysses, ring) and pipeline parallelism
(every schedule) on 2 and 4 ranks, every family, run by the existing tests in a child pytest with
PHALANX_EMULATE_GPU=1, their ranks inheriting it. The rank bodies move their batches with
`phalanx.device.to_device`; the single-process references stay on the CPU.

Also the hybrid checkpoint (optimizer fragments gathered over tp, saved under tp2 ZeRO-1 and
loaded in other layouts) and the streamed save against the gathered state dict on 2 ranks: both
gathered CPU tensors over tp before the emulator caught it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

HYBRID = "tests/framework/test_hybrid.py"
PIPELINE = "tests/framework/test_pipeline.py"


@pytest.mark.slow
def test_tp_sp_layouts_and_hybrid_checkpoints_match_one_process_on_the_emulated_gpu():
    out = pytest_emulated(f"{HYBRID}::test_two_rank_layouts_match_single_process",
                          f"{HYBRID}::test_four_rank_layouts_match_single_process",
                          f"{HYBRID}::test_checkpoints_move_between_layouts_and_plugins",
                          "tests/framework/test_hybrid_save.py::test_streamed_save_two_ranks")
    assert "4 passed" in out, out[-3000:]


@pytest.mark.slow
def test_pipeline_schedules_match_one_process_on_the_emulated_gpu():
    out = pytest_emulated(f"{PIPELINE}::test_pp2_every_schedule_and_family_matches_single_process",
                          f"{PIPELINE}::test_four_rank_layouts_match_single_process")
    assert "2 passed" in out, out[-3000:]
