"""Dynamic Axial Parallelism (FastFold): the Evoformer's activations split along one axis.

Each rank of a DAP group holds 1/n of the MSA rows (for row-wise ops) or of its residue columns
(column-wise ops), and 1/n of the pair representation's rows. Between a row-wise and a
column-wise operation the split axis changes with one all-to-all; an operation that needs a
whole tensor (a pair bias, the right operand of a triangle update) all-gathers it. All three
collectives are autograd functions, so the backward pass runs the matching collectives.

Model code calls one `Axial` object: `Axial()` is one process (every method is the identity),
`DapAxial(group)` the real thing. The model never asks which one it has.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.sequence.comm import all_to_all
from phalanx.shard.comm import gather_along


class Axial:
    """One process: nothing is split."""
    size, rank = 1, 0

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole tensor from each rank's slice along `dim`."""
        return x

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a tensor every rank holds in full."""
        return x

    def transpose(self, x: torch.Tensor, split_dim: int, gather_dim: int) -> torch.Tensor:
        """Change which axis is split: gather `gather_dim` (split now), split `split_dim` (whole now)."""
        return x


class DapAxial(Axial):
    """Activations split over the ranks of `group` (default: the world)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group or dist.group.WORLD
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def _check(self, x: torch.Tensor, dim: int) -> None:
        if x.shape[dim] % self.size:
            raise ValueError(f"DAP over {self.size} ranks splits an axis of length {x.shape[dim]} (tensor "
                             f"{tuple(x.shape)}, dim {dim}): pad residues and MSA rows to a multiple of {self.size} "
                             "(crop_size, max_msa_clusters, max_extra_msa)")

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return gather_along(x, dim % x.dim(), self.group)  # backward: reduce-scatter

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self._check(x, dim)
        return _Scatter.apply(x, dim % x.dim(), self.group)

    def transpose(self, x: torch.Tensor, split_dim: int, gather_dim: int) -> torch.Tensor:
        self._check(x, split_dim)
        return all_to_all(x, split_dim % x.dim(), gather_dim % x.dim(), self.group)


def _slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim)[r].contiguous()


# Gradients. Every collective's backward is its exact adjoint, so each rank's backward gives the
# gradient of J = sum over ranks of the loss each computes. Every rank computes the whole loss (the
# structure module and heads run replicated), so J = n x loss: averaging the parameter gradients
# over the group -- what DDP does anyway -- gives exactly the one-process gradient.

class _Scatter(torch.autograd.Function):
    """Take this rank's slice of its own full copy; adjoint: that slice's gradient, zeros elsewhere."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.shape = dim, group, x.shape
        return _slice(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        full = grad.new_zeros(ctx.shape)
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        full.chunk(n, ctx.dim)[r].copy_(grad)
        return full, None, None
