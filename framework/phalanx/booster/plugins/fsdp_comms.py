"""FSDP2's two collectives, replaced on gloo by the ones gloo runs fast.

FSDP2 all-gathers each block's parameters (`all_gather_single`) and reduce-scatters its gradients
(`reduce_scatter_single`). On gloo both are slow next to their alternatives (2 ranks, 84 MB fp32,
CPU time per rank, docs/zero.md): reduce_scatter 118 ms against all_reduce 62, all_gather 125
against one broadcast per rank 2 × 24. The ZeRO plugin already reduces and publishes that way;
these classes give FSDP2 the same through its public hooks (`set_custom_reduce_scatter`,
`set_custom_all_gather`). NCCL keeps FSDP2's own collectives: there the real ones are the fast ones.

The reduce-scatter runs synchronously (FSDP2 reads its output right away on CPU). The all-gather
returns a work handle (`_Works`, the broadcasts still in flight), which FSDP2 waits on only when it
copies the result out, so a gather FSDP2 prefetches (its backward prefetch of the next block in
reverse order) runs in gloo's thread while the current block computes. An explicit forward
prefetch of the next block (`set_modules_to_forward_prefetch`) was measured and left out: on the
large bench model (2 ranks, 2 cores, AVX512-BF16 EPYC) it made the step slower, fp32 3,922 against
3,663 ms and bf16 2,172 against 2,026 (its gathers compete with backward's for the two cores);
docs/zero.md.
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


class _Works(dist.Work):
    """Several collectives' handles as one: FSDP2 waits on a `dist.Work` before it reads an
    all-gather's output (`foreach_all_gather_copy_out`)."""

    def __init__(self, works: list[dist.Work]):
        super().__init__()
        self._works = works

    def wait(self, timeout=None) -> bool:
        for work in self._works:
            work.wait()
        return True


class BroadcastAllGather(DefaultAllGather):
    """All-gather as one broadcast per rank of its shard into its slot of the output (the output
    is the ranks' shards back to back, as `all_gather_single` lays them out). Returns the
    broadcasts' handles unwaited, whatever `async_op` says: FSDP2 waits on them before it reads
    the output, so a prefetched block's gather overlaps the current block's compute."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slots = output_tensor.view(world, -1)
        slots[rank].copy_(input_tensor.view(-1))
        return _Works([dist.broadcast(slots[i], src=dist.get_global_rank(group, i), group=group, async_op=True)
                       for i in range(world)])


def use_gloo_collectives(modules: list[FSDPModule], group: dist.ProcessGroup) -> bool:
    """Give every FSDP module the gloo-fast collectives when `group` runs on gloo; True if it did."""
    if not is_gloo(group) or dist.get_world_size(group) < 2:
        return False
    for module in modules:
        module.set_custom_reduce_scatter(AllReduceScatter())
        module.set_custom_all_gather(BroadcastAllGather())
    return True
