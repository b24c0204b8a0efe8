"""DeepSeek-V2 / V3 (multi-head latent attention) in the engine under the emulated GPU
(`PHALANX_EMULATE_GPU=1`): the latent cache, the absorbed query and the router run on `cuda:0`
(emulated) with device checks enforced, and at TP=2 over the NCCL-path backend; tokens still equal
transformers'. The tests of tests/framework/test_inference_deepseek.py run unchanged in one child
pytest (the kernels' torch references, the emulator's default), and V3's greedy test once more
through phalanx_kernels' Triton kernels in Triton's interpreter (the path a GPU takes)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from emulated_run import pytest_emulated  # noqa: E402

DEEPSEEK = "tests/framework/test_inference_deepseek.py::"
NODE_IDS = [
    DEEPSEEK + "test_greedy_tokens_and_logprobs_match_transformers[v2-groups-biases]",
    DEEPSEEK + "test_greedy_tokens_and_logprobs_match_transformers[v3-yarn]",
    DEEPSEEK + "test_preemption_and_prefix_cache_give_transformers_tokens",
    DEEPSEEK + "test_speculative_decoding_with_itself_as_draft",
    DEEPSEEK + "test_tp2_matches_tp1_and_transformers",
]


@pytest.mark.slow
def test_deepseek_inference_under_the_emulated_gpu():
    out = pytest_emulated(*NODE_IDS)
    assert f"{len(NODE_IDS)} passed" in out and "skipped" not in out, out[-3000:]


@pytest.mark.slow
def test_deepseek_runs_the_triton_kernels_on_the_emulated_gpu():
    """The latent cache through phalanx_kernels' Triton kernels in the interpreter: paged decode
    attention with one key head of width kv_lora_rank + rope, flash attention for the prompts."""
    out = pytest_emulated(NODE_IDS[1], PHALANX_EMULATE_TRITON="1")
    assert "1 passed" in out, out[-3000:]
