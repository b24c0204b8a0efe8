"""The mixture-of-experts decoder under the emulated GPU (`PHALANX_EMULATE_GPU=1`): the engine runs
Mixtral and Qwen2-MoE on `cuda:0` (emulated) with device checks enforced, and at TP=2 over the
NCCL-path backend; tokens still equal transformers'. The tests of tests/framework/test_inference_moe.py
run unchanged in one child pytest."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

MOE = "tests/framework/test_inference_moe.py::"
NODE_IDS = [
    MOE + "test_moe_greedy_tokens_and_logprobs_match_transformers[mixtral]",
    MOE + "test_moe_greedy_tokens_and_logprobs_match_transformers[qwen2_moe]",
    MOE + "test_moe_tp2_matches_transformers",
]


@pytest.mark.slow
def test_moe_inference_under_the_emulated_gpu():
    out = pytest_emulated(*NODE_IDS)
    assert "3 passed" in out and "skipped" not in out, out[-3000:]
