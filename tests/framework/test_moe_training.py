"""Mixture-of-experts models train under HybridParallelPlugin's tensor parallelism with the MoE
shard policies (phalanx.models.moe: attention split, router and experts whole on every rank, no
expert parallelism yet): one SGD step at tp=2 on 2 gloo ranks equals one process (loss and every
weight after the step, in Hugging Face names). One spawn, ~10 s."""
from __future__ import annotations

from moe_workers import tp_step
from phalanx.testing import spawn

FP32_RTOL = 1e-5  # fp32, a step of a 2-layer model whose attention output is summed over 2 ranks


def test_moe_tp2_step_equals_one_process():
    """tp2, and tp2 with split-gather sequence parallelism (the block then runs on each rank's
    tokens, its gradients summed over the group). A dense MLP's input hook on the block counted
    its input gradient twice (embedding update off by 51%): this caught it."""
    layouts = {"tp2": {"tp_size": 2}, "tp2 sp": {"tp_size": 2, "sequence_parallelism": "split_gather"}}
    ranks = spawn(tp_step, 2, ["mixtral", "qwen2_moe"], layouts)
    for layout, families in ranks[0].items():
        for family, got in families.items():
            assert got["names"] == [], (layout, family)
            assert got["loss"].value < FP32_RTOL and got["update"].value < FP32_RTOL, (layout, family, got)
