"""The router losses under pipeline parallelism (HybridParallelPlugin(pp_size=2), 1F1B with 2
microbatches): the Switch load-balancing loss (config.output_router_logits, coefficient 0.5) and
the z-loss (router_z_loss=0.1) carried through the stages (phalanx.pipeline.router_losses). Two
clipped SGD steps of the tiny Mixtral equal one process: losses, gradient norms and every weight
after the steps (tests/framework/expert_parallel_pp_workers.py says what one process computes)."""
from __future__ import annotations

import pytest

from expert_parallel_plugin_workers import ROWS
from expert_parallel_pp_workers import balancer_loads_under_pp, deepseek_pp_steps, pp_steps
from phalanx.testing import check, rounding_rtol, spawn
import torch

FP32_RTOL = rounding_rtol(torch.float32, ROWS * 16)  # 8·eps·√128 = 1.1e-5 (test_expert_parallel_plugin.py's)
UPDATE_RTOL = 1e-5  # two SGD steps, as test_expert_parallel_plugin.py
PP = {"pp_size": 2, "num_microbatches": 2}


def _check(ranks: list[dict]) -> None:
    for rank, layouts in enumerate(ranks):
        for name, got in layouts.items():
            what = f"{name} rank {rank}"
            check(got["losses"], FP32_RTOL, f"{what} losses")
            check(got["norms"], FP32_RTOL, f"{what} gradient norms")
            if "evaluation" in got:  # execute_pipeline(forward_only=True) of a fresh batch: the cross-entropy
                check(got["evaluation"], FP32_RTOL, f"{what} evaluation loss")
            if rank == 0:
                assert got["names"] == [], (what, got["names"])
                check(got["update"], UPDATE_RTOL, f"{what} weights after the steps")


def test_router_losses_under_pp2_equal_one_process():
    """pp2 on 2 ranks (ZeRO-0: dp1), each stage one of the two expert blocks."""
    _check(spawn(pp_steps, 2, {"pp2": PP}, max_norm=0.5))


def test_router_losses_under_the_other_schedules_equal_one_process():
    """A 4-layer Mixtral under pp2 with GPipe, interleaved 1F1B (2 stages per rank, the totals
    passed between a rank's own stages too) and zero-bubble ZB-V (input and weight gradients
    apart), 2 microbatches each."""
    layouts = {schedule: {**PP, "pp_schedule": schedule} for schedule in ("gpipe", "interleaved", "zero_bubble")}
    _check(spawn(pp_steps, 2, layouts, max_norm=0.5, layers=4))


@pytest.mark.slow
def test_router_losses_under_pp2_with_ep2_and_dp2_equal_one_process():
    """4 ranks: ep2 × pp2 (ZeRO-1; the experts of each stage split over its 2 data ranks) and
    dp2 × pp2 without EP (ZeRO-0): the load-balancing loss's counts summed over the data ranks."""
    _check(spawn(pp_steps, 4, {"ep2 pp2": {**PP, "ep_size": 2, "zero_stage": 1}, "dp2 pp2": PP}, max_norm=0.5,
                 timeout=600))


def test_bias_balancer_skips_the_pipelines_shape_inference():
    """DeepSeek-V3's BiasBalancer under pp2 counts exactly the steps' assignments (every token of
    the batch, top-2, on each router of a rank's stage) over two steps: the forwards of torch's
    shape inference at the first step, which the PipelineRunner marks, are left out."""
    for rank, got in enumerate(spawn(balancer_loads_under_pp, 2)):
        assert got["loads"] and all(v == got["want"] for v in got["loads"].values()), (rank, got)


def test_deepseek_balance_loss_under_pp2_equals_one_process():
    """DeepSeek's balance loss (config.output_router_logits, aux_loss_alpha 0.1) under pp2 on 2
    ranks, its 3 layers split [dense, experts] | [experts]: V2's expert-level loss over the batch
    (per microbatch: each block's counts ride along) and V3's sequence-wise loss (per sequence: the
    whole batch's), two SGD steps against one process's gradient accumulation."""
    _check(spawn(deepseek_pp_steps, 2, {"v2 pp2": ("v2", False, PP), "v3 pp2": ("v3", True, PP)}))


@pytest.mark.slow
def test_deepseek_balance_loss_under_pp2_with_ep2_and_dp2_equals_one_process():
    """4 ranks: V2 per sequence under ep2 × pp2 (ZeRO-1), V3 over the batch under dp2 × pp2: the
    counts and sequences summed over the data ranks."""
    _check(spawn(deepseek_pp_steps, 4, {"v2 ep2 pp2": ("v2", True, {**PP, "ep_size": 2, "zero_stage": 1}),
                                        "v3 dp2 pp2": ("v3", False, PP)}, timeout=600))
