"""The protein model's dropout and bf16 prediction under the emulated GPU (`PHALANX_EMULATE_GPU=1`):
the dropout masks drawn on the device in training mode and none in eval, and `predict` loading a
checkpoint in bf16 on the device (fp32 islands) against fp32 on the same device."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402


@pytest.mark.slow
def test_protein_dropout_and_bf16_predict_emulated():
    pytest_emulated("tests/apps/protein/test_protein_dropout.py::test_training_draws_masks_and_eval_is_deterministic",
                    "tests/apps/protein/test_protein_bf16.py::test_predict_in_bf16_matches_fp32", timeout=600)
