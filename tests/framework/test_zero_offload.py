"""ZeRO CPU offload, made observable without a GPU (2 gloo ranks, one spawn).

On a CPU-only machine the device and the host are the same RAM, so comparing an offloaded run
with a plain one proves nothing about offloading. What is checked instead, per rank:

- traffic: the bytes the host store moved each step, device->host (the reduced gradient, in the
  communication dtype) and host->device (the updated shard, in the model dtype), against the
  sizes worked out below from the model's parameter shapes;
- placement, asked of the memory itself (`zero_offload_workers.place`): the fp32 master shards,
  their gradients and the optimizer state are in host memory — on a CPU-only machine the host
  pool of `phalanx.hostmem`, shared pages that /proc/self/maps tells apart from torch's private
  allocations — and the model's parameters are not; the kernel's RssShmem grew by the master
  shard and the Adam moments; the parameters hold the updated shard after the step;
- numerics: every offloaded run matches the same run without offload.

The same checks must fail on the runs without offload
(`test_the_checks_catch_a_run_that_does_not_offload`).
"""
from __future__ import annotations

import mmap
import os

import pytest

import zero_offload_workers as ow
import zero_workers as zw
from phalanx.testing import spawn

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="placement is read from Linux /proc")

WORLD = 2
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
# tiny_llama (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 KV heads, vocab 128, untied) in
# zero_workers' two param groups: matrices 128*32 (embedding) + 2 * (32*32 + 2 * 16*32 + 32*32
# + 3 * 64*32) + 128*32 (head) = 26624 elements; norm weights 5 * 32 = 160.
GROUP_NUMELS = (26624, 160)
PAGE = mmap.PAGESIZE


@pytest.fixture(scope="module")
def ranks():
    return spawn(ow.suite, WORLD, list(ow.CONFIGS), timeout=300)


def test_the_model_has_the_parameter_counts_worked_out_by_hand():
    from phalanx.testing import tiny_llama

    params = list(tiny_llama(seed=0).parameters())
    assert (sum(p.numel() for p in params if p.dim() >= 2), sum(p.numel() for p in params if p.dim() < 2)) \
        == GROUP_NUMELS


def expected_traffic(precision: str, rank: int, reductions: int = 1) -> tuple[int, int]:
    """(device->host, host->device) bytes per step on `rank`. Each group's flat buffer is padded
    to a multiple of the world size and cut into equal shards; a rank receives the reduced
    gradient of the real elements of its shard (padding gets none) once per reduction, and sends
    back its whole shard once per step."""
    to_host = to_device = 0
    for numel in GROUP_NUMELS:
        shard = -(-numel // WORLD)
        real = min(numel, (rank + 1) * shard) - rank * shard
        to_host += reductions * real * ITEMSIZE[precision]
        to_device += shard * ITEMSIZE[precision]
    return to_host, to_device


def assert_offloaded(result: dict, precision: str, reductions: int = 1) -> None:
    want = list(expected_traffic(precision, result["rank"], reductions))
    assert result["traffic"] == [want] * zw.STEPS
    assert result["places"] == {"master": ["host", "host"], "master_grad": ["host", "host"],
                                "model_params": ["device"], "optimizer_state": ["host"]}
    assert result["received_update"]
    # The kernel's count: master shard, exp_avg, exp_avg_sq per group, fp32, each in whole pages of
    # its own; the gradient shards were freed at the end of the step.
    shards = [-(-numel // WORLD) for numel in GROUP_NUMELS]
    assert result["shard_numels"] == shards
    from phalanx_kernels.accelerator import available

    if not available():  # CPU-only: the host pool is shared pages (phalanx.hostmem); with a GPU, pinned memory
        assert result["shmem_growth"] == sum(3 * -(-4 * n // PAGE) * PAGE for n in shards)


def test_hand_worked_traffic():
    # 26624 / 2 = 13312 and 160 / 2 = 80 elements per rank, no padding: (13312 + 80) * 4 bytes
    assert expected_traffic("fp32", 0) == expected_traffic("fp32", 1) == (53568, 53568)
    assert expected_traffic("bf16", 1, reductions=2) == (2 * 26784, 26784)


# offloaded run: (the same run without offload, precision, gradient reductions per step)
PAIRS = {"s2_fp32_offload": ("s2_fp32", "fp32", 1), "s1_bf16_offload": ("s1_bf16", "bf16", 1),
         "s2_fp16_offload": ("s2_fp16", "fp16", 1), "s2_fp32_offload_accum": ("s2_fp32_accum", "fp32", 2)}


@pytest.mark.parametrize("config", list(PAIRS))
def test_offload_moves_each_gradient_and_shard_once_and_keeps_state_on_the_host(config, ranks):
    _, precision, reductions = PAIRS[config]
    for rank in ranks:
        assert_offloaded(rank[config], precision, reductions)


@pytest.mark.parametrize("config", list(PAIRS))
def test_the_checks_catch_a_run_that_does_not_offload(config, ranks):
    plain, precision, reductions = PAIRS[config]
    result = ranks[0][plain]
    with pytest.raises(AssertionError):
        assert_offloaded(result, precision, reductions)
    assert result["traffic"] == [[0, 0]] * zw.STEPS and result["shmem_growth"] == 0
    assert result["places"]["master"] == ["device", "device"]


@pytest.mark.parametrize("config", list(PAIRS))
def test_offloaded_run_matches_the_run_without_offload(config, ranks):
    """Identical arithmetic on a CPU-only machine; on a GPU the update runs on the CPU instead, hence
    a tolerance rather than equality."""
    offloaded, plain = ranks[0][config], ranks[0][PAIRS[config][0]]
    assert not any(offloaded["skipped"]) and not any(plain["skipped"])
    assert max(abs(a - b) / abs(b) for a, b in zip(offloaded["losses"], plain["losses"], strict=True)) <= 1e-6
    assert offloaded["params"].keys() == plain["params"].keys()
    assert max((offloaded["params"][k] - plain["params"][k]).abs().max().item() for k in plain["params"]) <= 1e-6
