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


@pytest.mark.slow
def test_expert_parallel_plugin_on_the_emulated_gpu():
    """HybridParallelPlugin(ep_size=2) with ZeRO 0/1/2 on 2 ranks, its HF-layout save loaded under
    tp2 and by from_pretrained, and the optimizer state moved to ep2 ZeRO-0 and to tp2 without EP
    (tests/framework/test_expert_parallel_plugin.py). (The tp2 layout's router losses come from hooks
    on the routers since session 19, not from transformers' aux loss, whose integer histc on CUDA
    the emulated GPU cannot run.)"""
    out = pytest_emulated("tests/framework/test_expert_parallel_plugin.py::test_ep2_zero_stages_equal_one_process",
                          "tests/framework/test_expert_parallel_plugin.py::"
                          "test_optimizer_state_moves_between_ep_and_other_layouts")
    assert "2 passed" in out and "failed" not in out, out[-3000:]


@pytest.mark.slow
def test_lora_with_expert_parallelism_on_the_emulated_gpu():
    """LoRA adapters on attention and on the experts under ep2 (with dp2, tp2, pp2, ZeRO, fp16 with
    an injected overflow) against one process, saving and merging (tests/framework/test_lora_ep.py)."""
    out = pytest_emulated("tests/framework/test_lora_ep.py")
    assert " passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]


@pytest.mark.slow
def test_expert_parallelism_with_sequence_parallelism_on_the_emulated_gpu():
    """ep2 with Ulysses / ring sequence parallelism (and dp2) against one process, its checkpoints
    (tests/framework/test_expert_parallel_sp.py)."""
    out = pytest_emulated("tests/framework/test_expert_parallel_sp.py")
    assert " passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]


@pytest.mark.slow
def test_router_losses_under_pipeline_parallelism_on_the_emulated_gpu():
    """The load-balancing loss and z-loss carried through the pipeline stages (pp2 under four
    schedules, ep2 × pp2, dp2 × pp2), DeepSeek's balance losses the same way, against one process,
    and V3's BiasBalancer skipping the shape inference (tests/framework/test_expert_parallel_pp.py,
    slow tests included)."""
    out = pytest_emulated("tests/framework/test_expert_parallel_pp.py", "-m", "slow or not slow")
    assert "6 passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]
