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
        return _Gather.apply(x, dim % x.dim(), self.group)

    def scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        self._check(x, dim)
        return _Scatter.apply(x, dim % x.dim(), self.group)

    def transpose(self, x: torch.Tensor, split_dim: int, gather_dim: int) -> torch.Tensor:
        self._check(x, split_dim)
        return _AllToAll.apply(x, split_dim % x.dim(), gather_dim % x.dim(), self.group)


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim)


def _slice(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim)[r].contiguous()


# Gradients. Every collective's backward is its exact adjoint, so each rank's backward gives the
# gradient of J = sum over ranks of the loss each computes. Every rank computes the whole loss (the
# structure module and heads run replicated), so J = n x loss: averaging the parameter gradients
# over the group -- what DDP does anyway -- gives exactly the one-process gradient.

class _Gather(torch.autograd.Function):
    """all-gather; adjoint: reduce-scatter (sum the slice's gradient over ranks)."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return _slice(grad, ctx.dim, ctx.group), None, None


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


def _all_to_all(x: torch.Tensor, split_dim: int, gather_dim: int, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(n, split_dim)]
    outputs = [torch.empty_like(t) for t in inputs]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, gather_dim, group):
        ctx.split_dim, ctx.gather_dim, ctx.group = split_dim, gather_dim, group
        return _all_to_all(x, split_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.gather_dim, ctx.split_dim, ctx.group), None, None, None
