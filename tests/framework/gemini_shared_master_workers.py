"""What test_gemini_shared_master.py runs on spawned ranks: the tiny Llama trained by GeminiPlugin
in several placements twice, with an fp32 chunk's master shared with its shard
(`phalanx.gemini.chunk.SHARE_FP32_MASTER`, the default) and as a separate copy (the previous
behaviour), returning losses, final weights, how often a move parted or joined master and shard,
and the manager's byte accounting next to the bytes of the tensors the chunks really hold.
"""
from __future__ import annotations

import torch

import gemini_workers as gw
from plugin_cases import make_batches

CONFIGS = {
    # everything on the device: every fp32 master is its shard, nothing moves
    "static": dict(placement_policy="static"),
    # half the shards live on the host and half the optimizer chunks: masters part from their
    # shards when a host shard is fetched to the device, and join them again when it goes home
    "static_offload": dict(placement_policy="static", offload_param_frac=0.5, offload_optim_frac=0.25),
    # shards start on the host with their masters, part from them when fetched during warm-up and
    # join them again when the optimizer chunks move to the device after it
    "auto": dict(placement_policy="auto", device_memory_budget=gw.BUDGET),
    # a budget the model does not fit (2 ranks: ~330 kB of chunks, ~300 kB of activations): idle
    # shards are also evicted to the host and fetched back, parting and joining all along
    "auto_evicting": dict(placement_policy="auto", device_memory_budget=500_000),
}


def held_bytes(manager) -> dict[str, int]:
    """Bytes per tier of the distinct tensors the chunks hold between steps (a master that is
    its shard once): what `MemoryTiers` must report."""
    from phalanx.gemini.tiers import DEVICE, DISK, HOST, nbytes

    out = {DEVICE: 0, HOST: 0, DISK: 0}
    for c in manager.chunks:
        out[c.shard_tier] += nbytes(c.shard)
        if c.optim_tier != DISK:
            tensors = [c.exp_avg, c.exp_avg_sq, c.master_grad] + ([] if c.master_is_shard else [c.master])
            out[c.optim_tier] += sum(nbytes(t) for t in tensors)
        if c.full is not None and not c.full_is_shard:
            out[DEVICE] += nbytes(c.full)
    return out


def _count_moves(manager, counts: dict[str, int]) -> None:
    """Wrap the manager's moves to count master/shard partings and joinings."""
    for name in ("move_shard", "move_optim"):
        move = getattr(manager, name)

        def counted(chunk, tier, _move=move):
            before = chunk.master_is_shard
            _move(chunk, tier)
            if before and not chunk.master_is_shard:
                counts["parted"] += 1
            elif chunk.master_is_shard and not before:
                counts["joined"] += 1
                assert chunk.shard.data_ptr() == chunk.master.data_ptr()

        setattr(manager, name, counted)


def _run(config: dict, precision: str) -> dict:
    booster, plugin, model, opt = gw.build(config, precision=precision)
    m = plugin.manager
    counts = {"parted": 0, "joined": 0}
    _count_moves(m, counts)
    shared_at_start = sum(c.master_is_shard for c in m.chunks)
    losses = gw._train(booster, model, opt, make_batches(5))
    # between steps a separate fp32 master still equals its shard bit for bit (what joining relies on)
    apart_equal = all(torch.equal(c.master.cpu(), c.shard.float().cpu()) for c in m.chunks
                      if c.dtype == torch.float32 and not c.master_is_shard)
    return {"losses": losses, "state": plugin.full_model_state_dict(model), **counts,
            "shared_at_start": shared_at_start, "shared_at_end": sum(c.master_is_shard for c in m.chunks),
            "chunks": len(m.chunks), "evictions": m.stats["evictions"], "apart_equal": apart_equal,
            "accounted": {k: v for k, v in m.tiers.bytes.items()}, "held": held_bytes(m),
            "peak_device": m.tiers.peak_device, "budget": m.tiers.budget}


def shared_vs_separate_suite() -> dict:
    from phalanx.gemini import chunk as chunk_module

    out = {}
    try:
        for share in (True, False):
            chunk_module.SHARE_FP32_MASTER = share
            for name, config in CONFIGS.items():
                out[f"{name}/{share}"] = _run(config, "fp32")
            out[f"bf16/{share}"] = _run(CONFIGS["static"], "bf16")
    finally:
        chunk_module.SHARE_FP32_MASTER = True
    return out
