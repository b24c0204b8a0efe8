"""Gemini in fp32: a chunk's master IS its shard where both live on one tier (issue 19).

A separate fp32 master would be a bit-for-bit duplicate of an fp32 shard (4 of the 20 bytes a
parameter). Checked here: the storage is shared and counted once; moves between tiers part
master and shard (the master becomes a real copy, counted on its own tier) and join them again;
the placement arithmetic counts what is allocated; bf16 and the disk tier keep a separate master;
and training is bit-identical to separate copies (the module switch `SHARE_FP32_MASTER`), on 2
ranks in placements that part and join them during training.
"""
from __future__ import annotations

import pytest
import torch

import gemini_shared_master_workers as sw
from phalanx.gemini import ChunkManager, MemoryTiers, StaticPlacement
from phalanx.gemini import chunk as chunk_module
from phalanx.gemini.placement import host_need
from phalanx.gemini.tiers import DEVICE, DISK, HOST
from phalanx.testing import spawn


def _manager(dtype=torch.float32, shard_tier=DEVICE, optim_tier=DEVICE, budget=10**6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).to(dtype)
    m = ChunkManager(list(model.named_parameters()), chunk_numel=80, dp_size=1, dp_rank=0, group=None,
                     tiers=MemoryTiers(torch.device("cpu"), budget))
    m.policy = StaticPlacement()
    n = len(m.chunks)
    m.materialise([shard_tier] * n, [optim_tier] * n)
    return m


def _bytes(m):
    return {k: v for k, v in m.tiers.bytes.items() if k != DISK}


def test_an_fp32_master_is_its_shard_and_counted_once():
    m = _manager()
    for c in m.chunks:
        assert c.master_is_shard and c.master.untyped_storage().data_ptr() == c.shard.untyped_storage().data_ptr()
    n = sum(c.shard_numel for c in m.chunks)
    assert _bytes(m) == {DEVICE: 16 * n, HOST: 0}  # shard = master, two moments, gradient
    chunk = m.chunks[0]
    before = chunk.shard.clone()
    m.publish(chunk)  # the "apply master to shard" copy has nothing to do
    assert torch.equal(chunk.shard, before)


def test_bf16_keeps_a_separate_fp32_master():
    m = _manager(torch.bfloat16)
    n = sum(c.shard_numel for c in m.chunks)
    assert not any(c.master_is_shard for c in m.chunks)
    assert all(c.master.dtype == torch.float32 and c.shard.dtype == torch.bfloat16 for c in m.chunks)
    assert _bytes(m) == {DEVICE: 2 * n + 16 * n, HOST: 0}


def test_the_switch_restores_the_separate_copy(monkeypatch):
    monkeypatch.setattr(chunk_module, "SHARE_FP32_MASTER", False)
    m = _manager()
    n = sum(c.shard_numel for c in m.chunks)
    assert not any(c.master_is_shard for c in m.chunks) and _bytes(m) == {DEVICE: 20 * n, HOST: 0}


def test_moves_part_and_join_master_and_shard_with_honest_bytes():
    m = _manager()
    c = m.chunks[0]
    n, rest = c.shard_numel, sum(x.shard_numel for x in m.chunks[1:])
    values = c.master.clone()
    total = {DEVICE: 16 * rest, HOST: 0}

    def expect(device: int, host: int):
        assert _bytes(m) == {DEVICE: total[DEVICE] + device * n, HOST: host * n}
        assert torch.equal(c.shard, values) and torch.equal(c.master, values)
        assert c.shard.device.type == "cpu"  # both tiers are CPU memory here; the pool is apart

    m.move_shard(c, HOST)  # the shard leaves: the master stays on the device, the shard is a copy
    assert not c.master_is_shard and c.shard_tier == HOST
    expect(16, 4)
    m.move_shard(c, DEVICE)  # back beside its master: one tensor again, the copy dropped
    assert c.master_is_shard
    expect(16, 0)
    m.move_optim(c, HOST)  # the optimizer state leaves: the shard stays, the master is a copy
    assert not c.master_is_shard and c.optim_tier == HOST
    expect(4, 16)
    assert m.optim_move_bytes(c, DEVICE) == 12 * n  # the master would be the device shard
    m.move_shard(c, HOST)  # the shard joins its master on the host
    assert c.master_is_shard
    expect(0, 16)
    assert m.device_need(c) == c.shard_bytes()  # a fetch copies the host shard (world 1: no gather buffer)
    m.move_optim(c, DEVICE)  # a master that is the host shard is copied to the device
    assert not c.master_is_shard
    expect(16, 4)
    assert m.device_need(c) == 0  # a fetch would make the device master the shard: no new bytes


def test_training_updates_a_shared_master_and_a_parted_one_alike():
    """One process, world 1: the chunk's master is updated in place; where it is the shard the
    parameters see the new values without a copy, where it is apart `publish` copies them."""
    from phalanx.gemini import GeminiOptimizer
    from phalanx.gemini.hooks import install_hooks
    from phalanx.gemini.tracer import MemoryTracer

    results = []
    for part in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        m = ChunkManager(list(model.named_parameters()), chunk_numel=80, dp_size=1, dp_rank=0, group=None,
                         tiers=MemoryTiers(torch.device("cpu"), 10**6))
        m.policy = StaticPlacement(tracer=MemoryTracer(m))
        install_hooks(m, model, m.policy.tracer)
        m.materialise(*m.policy.initial_tiers(m))
        if part:
            m.move_optim(m.chunks[1], HOST)
            assert not m.chunks[1].master_is_shard and m.chunks[0].master_is_shard
        opt = GeminiOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), m)
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(4):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        results.append((losses, [c.shard.clone() for c in m.chunks]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    assert results[0][0][-1] < results[0][0][0]


def test_placement_arithmetic_counts_a_shared_master_once():
    m = _manager()
    chunks, n = m.chunks, [c.shard_numel for c in m.chunks]
    # host: shard on the host is the master; moments 8 bytes, gradient 4; on disk, the master is apart
    need = host_need(chunks, [HOST, HOST], [HOST, DISK], disk_depth=1)
    assert need == {"shards": 4 * (n[0] + n[1]), "gradients": 4 * (n[0] + n[1]), "optimizer state": 8 * n[0],
                    "disk buffers": 2 * 12 * n[1]}
    assert host_need(chunks, [DEVICE, DEVICE], [HOST, HOST], 1)["optimizer state"] == 12 * (n[0] + n[1])
    bf16 = _manager(torch.bfloat16)
    assert host_need(bf16.chunks, [HOST] * 2, [HOST] * 2, 1)["optimizer state"] == 12 * sum(n)
    # static check_fits: everything on a budget of exactly 16 bytes an element plus the working set
    from phalanx.gemini.placement import NotEnoughDeviceMemory, min_working_set

    modules = {"0": [chunks[0]], "1": [chunks[1]]}
    work, _ = min_working_set(m, modules)
    m.tiers.budget = 16 * sum(n) + work
    StaticPlacement().check_fits(m, modules)
    m.tiers.budget -= 1
    with pytest.raises(NotEnoughDeviceMemory, match="missing"):
        StaticPlacement().check_fits(m, modules)


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(sw.shared_vs_separate_suite, 2, timeout=400)


@pytest.mark.slow
@pytest.mark.parametrize("config", [*sw.CONFIGS, "bf16"])
def test_two_ranks_train_bit_identically_to_separate_masters(config, two_ranks):
    for rank in two_ranks:
        shared, separate = rank[f"{config}/True"], rank[f"{config}/False"]
        assert shared["losses"] == separate["losses"]
        assert shared["state"].keys() == separate["state"].keys()
        for name, value in shared["state"].items():
            assert torch.equal(value, separate["state"][name]), name
        assert separate["shared_at_start"] == separate["shared_at_end"] == 0
        assert shared["apart_equal"] and separate["apart_equal"]
        for run in (shared, separate):  # the accounting is what the chunks hold, either way
            assert run["accounted"] == run["held"], (config, run["accounted"], run["held"])
        if config == "bf16":
            assert shared["shared_at_start"] == 0 and shared["accounted"] == separate["accounted"]
        else:  # fp32: the shared run holds less, by the masters that are shards
            assert shared["shared_at_start"] > 0
            saved = separate["accounted"][DEVICE] + separate["accounted"][HOST] \
                - shared["accounted"][DEVICE] - shared["accounted"][HOST]
            assert saved > 0


@pytest.mark.slow
def test_moves_part_and_join_masters_during_training(two_ranks):
    for rank in two_ranks:
        static = rank["static/True"]
        assert static["shared_at_start"] == static["shared_at_end"] == static["chunks"]
        assert static["parted"] == static["joined"] == 0
        offload = rank["static_offload/True"]
        assert offload["parted"] > 0 and offload["joined"] > 0  # each fetch of a host shard to its device master
        auto = rank["auto/True"]
        assert auto["parted"] > 0 and auto["joined"] > 0 and auto["shared_at_end"] == auto["chunks"]
        evicting = rank["auto_evicting/True"]
        assert evicting["evictions"] > 0 and evicting["parted"] > 0 and evicting["joined"] > 0
        assert evicting["peak_device"] <= evicting["budget"]
