"""Differentiable collectives for tensor and sequence parallelism (Megatron's f/g operators).

Each function is an autograd Function over one process group; its backward is the adjoint of its
forward, so `loss.backward()` moves gradients between ranks by itself:

| function | forward | backward |
|---|---|---|
| `copy_to_group` | identity | all-reduce (sum) |
| `reduce_from_group` | all-reduce (sum) | identity |
| `gather_along(dim)` | all-gather, concatenated along `dim` | reduce-scatter (sum) along `dim` |
| `reduce_scatter_along(dim)` | reduce-scatter (sum) along `dim` | all-gather along `dim` |
| `split_along(dim)` | keep this rank's chunk of `dim` | all-gather along `dim` |
| `gather_replicated(dim)` | all-gather along `dim` | keep this rank's chunk (the gradient is replicated) |

A group of one rank makes every function the identity.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.launch import collective


def _size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.contiguous()
    with collective("tp.all_reduce"):
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    with collective("tp.all_gather"):
        dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dimension {dim} of size {x.shape[dim]} over {n} ranks")
    parts = [p.contiguous() for p in x.chunk(n, dim=dim)]
    out = torch.empty_like(parts[0])
    with collective("tp.reduce_scatter"):
        dist.reduce_scatter(out, parts, op=dist.ReduceOp.SUM, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g.clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.dim, ctx.group), None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.dim, ctx.group), None, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceFromGroup.apply(x, group)


def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherAlong.apply(x, dim, group)


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if _size(group) == 1 else _ReduceScatterAlong.apply(x, dim, group)


def split_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if _size(group) == 1 else _SplitAlong.apply(x, dim, group)


def gather_replicated(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x if _size(group) == 1 else _GatherReplicated.apply(x, dim, group)


def all_reduce_no_grad(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce outside autograd (statistics, maxima)."""
    if _size(group) > 1:
        with collective("tp.all_reduce"):
            dist.all_reduce(x, op=op, group=group)
    return x
