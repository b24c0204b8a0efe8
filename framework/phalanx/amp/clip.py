"""Gradient norm and clipping when each rank holds only part of the gradients.

`global_grad_norm` sums the squares of the gradient pieces this rank owns and all-reduces the
sum over `group`: pass the group over which gradients are *sharded* (ZeRO-2, FSDP), or None for
replicated gradients (DDP), where each rank already sees every gradient.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from phalanx_kernels.accelerator import current_device


def global_grad_norm(grads: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None,
                     sharded: bool = False, norm_type: float = 2.0) -> float:
    grads = [g for g in grads if g is not None]
    device = grads[0].device if grads else current_device()  # a rank with no gradients: still the run's device
    if norm_type == math.inf:
        local = torch.stack([g.detach().abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        total = local.reshape(1).clone()
        if sharded and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return float(total.item())
    if grads:
        # One fused pass per dtype (no squared copy of every gradient), accumulated in fp32.
        norms = torch._foreach_norm([g.detach() for g in grads], norm_type, dtype=torch.float32)
        local = torch.stack([n.float() for n in norms]).pow(norm_type).sum()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
    total = local.reshape(1).clone()
    if sharded and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return float(total.item() ** (1.0 / norm_type))


def clip_coefficient(max_norm: float | None, total_norm: float) -> float:
    """The factor that brings gradients of global norm `total_norm` to at most `max_norm` (1.0:
    no clipping needed, or none asked for, or a non-finite norm)."""
    if max_norm is None or max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_grads(grads: Iterable[torch.Tensor], coef: float) -> None:
    """Multiply gradients in place by a clipping factor (nothing to do at 1.0)."""
    if coef < 1.0:
        for g in grads:
            if g is not None:
                g.detach().mul_(coef)


def clip_grads_by_norm(grads: Iterable[torch.Tensor], max_norm: float, total_norm: float) -> float:
    """Scale gradients in place so their global norm is at most `max_norm`; returns the factor."""
    coef = clip_coefficient(max_norm, total_norm)
    clip_grads(grads, coef)
    return coef
