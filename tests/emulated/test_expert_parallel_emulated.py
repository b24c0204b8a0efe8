"""Expert parallelism on the emulated GPU: the all-to-all dispatch and the expert / dense gradient
reductions on device tensors over the NCCL-path backend (tests/framework/test_expert_parallel.py,
run in a child pytest with PHALANX_EMULATE_GPU=1, its ranks inheriting it)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402


@pytest.mark.slow
def test_expert_parallel_on_the_emulated_gpu():
    out = pytest_emulated("tests/framework/test_expert_parallel.py")
    assert " passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]
