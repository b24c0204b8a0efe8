"""precision=fp8 on the emulated GPU (compute capability 9.0): 2-rank DDP, ZeRO-2 and FSDP2 training with torchao's
float8 linears through torch's `_scaled_mm`, against bf16 (tests/framework/test_fp8_precision.py,
skipped where no fp8 device exists, run here in a child pytest with PHALANX_EMULATE_GPU=1)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

from phalanx.amp.precision import host_fp8_matmul  # noqa: E402


@pytest.mark.slow
@pytest.mark.skipif(not host_fp8_matmul(), reason="the emulated GPU computes on this CPU, whose kernels do not multiply "
                    "fp8 reliably (AVX2 oneDNN: phalanx.amp.precision.host_fp8_matmul)")
def test_fp8_training_on_the_emulated_gpu():
    out = pytest_emulated("tests/framework/test_fp8_precision.py::test_fp8_training_follows_bf16_on_two_ranks")
    assert "1 passed" in out, out[-3000:]
