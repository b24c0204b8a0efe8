"""DeepSeek-V3 on the emulated GPU: tp2 (multi-head latent attention split by heads) and ep2 with the
correction-bias balancer, the HF-layout save loaded under tp2 and by from_pretrained
(tests/framework/test_deepseek_family.py, run in a child pytest with PHALANX_EMULATE_GPU=1, its
ranks inheriting it). DeepSeek-V2 is left out: its complex-number RoPE (`view_as_complex`) gets
wrong gradients on emulated tensors even in one process (the emulator's limit, not the family's:
its tp2 test passes on the CPU)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

FILE = "tests/framework/test_deepseek_family.py"


@pytest.mark.slow
def test_deepseek_v3_on_the_emulated_gpu():
    out = pytest_emulated(f"{FILE}::test_tp2_equals_one_process[v3]",
                          f"{FILE}::test_ep2_v3_equals_one_process_and_saves_hf_layout",
                          f"{FILE}::test_bias_balancer_moves_the_correction_bias_against_the_load")
    assert "3 passed" in out and "failed" not in out, out[-3000:]
