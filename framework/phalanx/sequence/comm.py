"""Communication for sequence parallelism: the differentiable all-to-all that Ulysses uses, and
the ring exchange (batched isend/irecv to the next and from the previous rank) of ring attention.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.launch import collective


def _all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(n, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(n)]
    with collective("sp.all_to_all"):
        dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, g):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(g, gather_dim, scatter_dim, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """Split `x` along `scatter_dim` over the ranks of `group` and concatenate what arrives along
    `gather_dim` (in rank order). Its backward is the reverse all-to-all."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


class RingExchange:
    """Send tensors to the next rank of the ring and receive the same shapes from the previous one,
    asynchronously: `start(tensors)` then `wait()` returns the received tensors."""

    def __init__(self, group):
        self.group = group
        size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self._works = None
        self._received: list[torch.Tensor] = []

    def start(self, tensors: list[torch.Tensor]) -> None:
        tensors = [t.contiguous() for t in tensors]
        self._received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in self._received]
        with collective("sp.ring_exchange"):
            self._works = dist.batch_isend_irecv(ops)
        self._sending = tensors  # keep alive until the sends complete

    def wait(self) -> list[torch.Tensor]:
        with collective("sp.ring_exchange"):
            for w in self._works:
                w.wait()
        self._works, self._sending = None, None
        return self._received
