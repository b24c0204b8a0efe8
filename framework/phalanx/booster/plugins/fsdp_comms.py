"""FSDP2's two collectives, replaced on gloo by the ones gloo runs fast.

FSDP2 all-gathers each block's parameters (`all_gather_single`) and reduce-scatters its gradients
(`reduce_scatter_single`). On gloo both are slow next to their alternatives (2 ranks, 84 MB fp32,
CPU time per rank, docs/zero.md): reduce_scatter 118 ms against all_reduce 62, all_gather 125
against one broadcast per rank 2 × 24. The ZeRO plugin already reduces and publishes that way;
these classes give FSDP2 the same through its public hooks (`set_custom_reduce_scatter`,
`set_custom_all_gather`). NCCL keeps FSDP2's own collectives: there the real ones are the fast ones.

Both run synchronously (they return no work handle), which FSDP2 treats as a finished
collective; on CPU FSDP2 has no side streams to overlap with anyway.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

from phalanx.zero.comm import is_gloo

# ReduceOps that all_reduce on gloo applies exactly as reduce_scatter would (FSDP2 asks for AVG in
# fp32/bf16 and SUM with its own pre/post division in fp16).
_PLAIN_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)


class AllReduceScatter(DefaultReduceScatter):
    """Reduce-scatter as an in-place all-reduce of the (already full-size, temporary) input,
    then this rank's slice copied out: the same result, the same memory, half gloo's time."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if op not in _PLAIN_OPS:  # PREMUL_SUM and friends: gloo's own reduce-scatter knows them
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
        dist.all_reduce(input_tensor, op=op, group=group)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        output_tensor.copy_(input_tensor.view(world, -1)[rank])
        return None


class BroadcastAllGather(DefaultAllGather):
    """All-gather as one broadcast per rank of its shard into its slot of the output (the output
    is the ranks' shards back to back, as `all_gather_single` lays them out)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slots = output_tensor.view(world, -1)
        slots[rank].copy_(input_tensor.view(-1))
        works = [dist.broadcast(slots[i], src=dist.get_global_rank(group, i), group=group, async_op=True)
                 for i in range(world)]
        for work in works:
            work.wait()
        return None


def use_gloo_collectives(modules: list[FSDPModule], group: dist.ProcessGroup) -> bool:
    """Give every FSDP module the gloo-fast collectives when `group` runs on gloo; True if it did."""
    if not is_gloo(group) or dist.get_world_size(group) < 2:
        return False
    for module in modules:
        module.set_custom_reduce_scatter(AllReduceScatter())
        module.set_custom_all_gather(BroadcastAllGather())
    return True
