"""The tensor-parallel group an engine runs over, and the few collectives inference needs.

TP=1 needs no process group at all. For TP>1 the engine joins the group `phalanx.launch()` made
(gloo on CPU, NCCL on GPU): the whole world when it has tp_size ranks, else the "tp" dimension of
`phalanx.mesh.build_mesh`, so several TP replicas can run side by side. Rank 0 of the group is the
*driver*: it owns the scheduler, the sampler and the draft model, and broadcasts each step's
inputs to the other ranks, which only run the model (see `model_runner`).

A trainer that already holds a tensor-parallel group (HybridParallelPlugin's, for RLHF rollouts
colocated with training) hands it to its engine with `TPGroup.adopt`, so the engine's collectives
run on the very group the training shards live on.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


class TPGroup:
    def __init__(self, tp_size: int) -> None:
        self.size = tp_size
        self.group = None
        self.rank = 0
        self.driver = 0  # global rank of the group's rank 0
        if tp_size == 1:
            return
        if not dist.is_initialized():
            if "WORLD_SIZE" not in os.environ:
                raise RuntimeError(f"tp_size={tp_size} needs {tp_size} processes: start them with "
                                   f"`phalanx run -n {tp_size} script.py` (or torchrun) and call phalanx.launch()")
            from phalanx.launch import launch
            launch(seed=None)
        world = dist.get_world_size()
        if world == tp_size:
            self.group = dist.group.WORLD
        elif world % tp_size == 0:
            from phalanx.mesh import ParallelConfig, build_mesh
            self.group = build_mesh(ParallelConfig(tp=tp_size)).get_group("tp")
        else:
            raise ValueError(f"tp_size={tp_size} does not divide the world size {world}; start a multiple of "
                             f"{tp_size} processes")
        self.rank = dist.get_rank(self.group)
        self.driver = dist.get_global_rank(self.group, 0)

    def adopt(self, group) -> None:
        """Run over `group` from now on: an existing process group with the same ranks as this
        one (e.g. the tp group of the training layout). Call it on every rank of the group, with
        no request in flight."""
        if self.size == 1:
            raise ValueError("a tp_size=1 engine has no tensor-parallel group to replace")
        ranks = dist.get_process_group_ranks(group)
        mine = dist.get_process_group_ranks(self.group)
        if ranks != mine:  # same ranks in the same order: each keeps the shard it holds
            raise ValueError(f"the engine's tensor-parallel ranks {mine} differ from the group it is given {ranks}: "
                             "build the engine with the training layout's tp_size")
        self.group = group
        self.rank = dist.get_rank(group)
        self.driver = dist.get_global_rank(group, 0)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.broadcast(tensor, src=self.driver, group=self.group)
        return tensor

    def gather_to_driver(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's tensor (same shape) on the driver; None elsewhere."""
        if self.is_driver:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            dist.gather(tensor, parts, dst=self.driver, group=self.group)
            return parts
        dist.gather(tensor, None, dst=self.driver, group=self.group)
        return None

    def broadcast_object(self, obj=None):
        box = [obj]
        dist.broadcast_object_list(box, src=self.driver, group=self.group)
        return box[0]
