"""Rank bodies for test_fsdp_comms.py: the gloo replacements against torch's own collectives."""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.booster.plugins.fsdp_comms import AllReduceScatter, BroadcastAllGather


def compare_with_torch_collectives() -> dict[str, float]:
    """Max |difference| between ours and torch's, per collective and op, on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(rank)
    out = {}
    shard = torch.randn(37, generator=gen)
    want = torch.empty(37 * world)
    dist.all_gather_into_tensor(want, shard, group=group)
    got = torch.full((37 * world,), float("nan"))
    work = BroadcastAllGather()(got, shard, group)
    assert isinstance(work, dist.Work)  # FSDP2 waits on a Work before it reads the output
    work.wait()
    out["all_gather"] = (got - want).abs().max().item()
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        full = torch.randn(world * 41, generator=gen)
        want = torch.empty(41)
        dist.reduce_scatter_tensor(want, full.clone(), op=op, group=group)
        got = torch.full((41,), float("nan"))
        AllReduceScatter()(got, full.clone(), group, op)
        out[f"reduce_scatter_{name}"] = (got - want).abs().max().item()
    return out
