"""Optimizers for a tensor-parallel model, over the data(×sequence)-parallel group.

- `HybridZeroOptimizer`: the ZeRO-1/2 optimizer (`phalanx.zero.ZeroOptimizer`, unchanged) on this
  tensor-parallel rank's pieces, with a gradient norm that counts every element of the whole
  model once (see `phalanx.shard.grads`), and partial gradients summed over the tensor-parallel
  group before ZeRO reduces them.
- `HybridOptimizer` (zero_stage=0): whole local pieces on every data-parallel rank; gradients
  all-reduced (averaged) over the data(×sequence)-parallel group at `step`, fp32 masters for
  bf16/fp16 as in `MixedPrecisionOptimizer`.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from phalanx.amp.mixed_precision_optimizer import MixedPrecisionOptimizer
from phalanx.amp.precision import Precision
from phalanx.shard.grads import PartialGradSync, flat_all_reduce, weighted_norm
from phalanx.zero.optimizer import ZeroConfig, ZeroOptimizer

if not hasattr(ZeroOptimizer, "_global_norm"):  # pragma: no cover - guards the one override below
    raise ImportError("phalanx.zero.ZeroOptimizer no longer has _global_norm(grads); update "
                      "phalanx.shard.optim.HybridZeroOptimizer")


class HybridZeroOptimizer(ZeroOptimizer):
    """ZeroOptimizer whose norm weighs each owned gradient element by 1 / its copies over the
    tensor-parallel group (`weights`: id(model parameter) -> weight)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: ZeroConfig, *, names: dict[int, str],
                 process_group, weights: dict[int, float], partial: PartialGradSync, precision=None):
        self.partial = partial  # hooks registered before ZeRO's: partial gradients are summed first
        super().__init__(optimizer, config, names=names, process_group=process_group, precision=precision)
        self.norm_weights = weights

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        return weighted_norm(self.norm_pieces(), self.device)

    def norm_pieces(self) -> list[tuple[torch.Tensor, float]]:
        """(owned gradient piece, weight) pairs of this rank, for `weighted_norm`."""
        pieces = []
        for g in self.flat_groups:
            if g is None or g.master.grad is None:
                continue
            for slot, a, b in g.layout.owned_slots(self.rank):
                start = g.layout.to_shard(self.rank, slot.offset + a)
                pieces.append((g.master.grad[start:start + (b - a)], self.norm_weights[id(g.params[slot.index])]))
        return pieces

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync(), self.partial.no_sync():
            yield


class HybridOptimizer(MixedPrecisionOptimizer):
    """Stage 0: every data(×sequence)-parallel rank keeps its tensor-parallel pieces whole."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, names: dict[int, str], precision: str | Precision,
                 max_norm: float | None, dp_group, tp_group, partial_ids: set[int], weights: dict[int, float],
                 device: torch.device):
        super().__init__(optimizer, precision=precision, max_norm=max_norm, names=names)
        self.device = device  # the run's: the norm's all-reduce is carried there even with no gradients
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.partial_ids = partial_ids
        self.weights = weights

    def unscale_and_clip(self, defer_clip: bool = False) -> bool:
        pairs = []
        for p in self.model_params:
            if not p.requires_grad:
                continue
            target = self.master_of.get(id(p), p)
            if p.grad is not None and target is not p:
                target.grad = p.grad.detach().float()
                p.grad = None
            if target.grad is None:  # keep every rank's collectives the same
                target.grad = torch.zeros_like(target)
            pairs.append((p, target.grad))
        flat_all_reduce([g for p, g in pairs if id(p) in self.partial_ids], self.tp_group, name="tp.partial_grad")
        self.reduce_over_replicas(pairs)
        grads = [g for _, g in pairs]
        if not self.scaler.unscale_or_skip(grads):
            self.last_grad_norm = float("inf")
            return False
        dp = dist.get_world_size(self.dp_group) if self.dp_group is not None else 1
        self.last_grad_norm = weighted_norm(((g, self.weights[id(p)] / dp) for p, g in pairs), self.device)
        return self._clip_or_defer(grads, self.last_grad_norm, defer_clip)

    def reduce_over_replicas(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Average the (parameter, gradient) pairs' gradients over the data(×sequence) replicas."""
        flat_all_reduce([g for _, g in pairs], self.dp_group, average=True, name="dp.all_reduce_grads")
