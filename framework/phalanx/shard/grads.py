"""Gradients of a tensor-parallel model: completing partial gradients, syncing replicas, and the
gradient norm over all shards.

Three kinds of parameters (see `ShardSpec`):
- split: each tensor-parallel rank holds a different piece with its complete gradient;
- replicated: every tensor-parallel rank holds the same value and the same gradient;
- replicated with partial gradients (norms under split-gather, per-head norms, replicated KV
  heads): each rank's gradient is a part; the sum over the tensor-parallel group is the gradient.

The global norm counts each element once: Σ over all ranks of g² / (number of ranks holding an
identical copy of g), all-reduced over the world. Split elements have copies only across the
data(×sequence)-parallel ranks (where ZeRO gives each element one owner), replicated ones also
across the tensor-parallel ranks.
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.launch import collective


def flat_all_reduce(tensors: list[torch.Tensor], group, *, average: bool = False, name: str = "tp.grads") -> None:
    """All-reduce a list of tensors of one dtype in one collective (in place)."""
    if not tensors or group is None or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    with collective(name):
        dist.all_reduce(flat, group=group)
    if average:
        flat.div_(dist.get_world_size(group))
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class PartialGradSync:
    """Sums the partial gradients of `params` over the tensor-parallel group as soon as backward
    has accumulated each one (a post-accumulate-grad hook, registered before the ZeRO optimizer's
    own hooks so it runs first). Inside `no_sync()` nothing happens: the local parts accumulate and
    the next synchronised backward sums the total once."""

    def __init__(self, params: Iterable[nn.Parameter], group):
        self.group = group
        self.enabled = True
        self.params = [p for p in params if p.requires_grad]
        if dist.get_world_size(group) > 1:
            for p in self.params:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: nn.Parameter) -> None:
        if self.enabled and p.grad is not None:
            with collective("tp.partial_grad"):
                dist.all_reduce(p.grad, group=self.group)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous


def weighted_norm(pieces: Iterable[tuple[torch.Tensor, float]], device, norm_type: float = 2.0) -> float:
    """The global norm from this rank's (gradient piece, weight) pairs, weight = 1 / copies; a
    collective over the world. An inf/nan anywhere makes the result non-finite on every rank."""
    if norm_type == math.inf:
        local = torch.zeros(1, dtype=torch.float32, device=device)
        for g, _ in pieces:
            if g.numel():
                local = torch.maximum(local, g.detach().abs().max().float().reshape(1).to(device))
        if dist.is_initialized() and dist.get_world_size() > 1:
            with collective("tp.grad_norm"):
                dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return float(local.item())
    local = torch.zeros(1, dtype=torch.float32, device=device)
    for g, w in pieces:
        if g.numel():
            local += (g.detach().float().pow(norm_type).sum() * w).to(device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with collective("tp.grad_norm"):
            dist.all_reduce(local)
    return float(local.item() ** (1.0 / norm_type))
