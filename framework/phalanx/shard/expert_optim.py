"""The optimizers of HybridParallelPlugin(ep_size > 1): dense weights and expert weights reduced
over different groups (docs/moe.md).

Dense weights (attention, norms, embeddings, router, shared expert) have one replica per
data-parallel rank, as without experts (under Ulysses/ring sequence parallelism: per data ×
sequence-parallel rank, dp × sp, each rank computing on its own tokens; read dp as dp × sp below).
An expert has one replica per *expert* data-parallel rank (the dp/ep ranks with the same EP
index), and its gradient on each of them already sums the contributions of the ep ranks whose
tokens it served (the backward all-to-all brought them). Its gradient is therefore first scaled by
1/ep (a tensor hook, `scale_expert_grads`) and then averaged over its own replicas: the sum over
dp/ep replicas divided by dp, the mean over every rank's loss, as the dense weights get.

- zero_stage 0: `ExpertHybridOptimizer`, `HybridOptimizer` whose replica reduction averages dense
  gradients over the data-parallel group and expert gradients over the expert data-parallel group.
- zero_stage 1/2: `ExpertZeroOptimizer`, two ZeRO optimizers, one over each group: the user's torch
  optimizer keeps the dense parameters (its param groups, its LR scheduler) and a twin of the same
  class and hyper-parameters takes the experts (`split_off_experts`), so the experts' fp32 masters
  and optimizer states are partitioned over their own replicas. One gradient norm covers both
  (the dense optimizer computes it and hands it to the experts'), so clipping is global. Under fp16
  one loss scaler (the dense optimizer's, the one the Booster saves) scales the loss for both; the
  experts' optimizer unscales by the scale of the step (`_FollowedScale`) and skips with the dense
  one (an overflow in any rank's experts makes the shared norm non-finite on every rank).
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch

from phalanx.amp.loss_scaler import DynamicLossScaler
from phalanx.shard.grads import PartialGradSync, flat_all_reduce, weighted_norm
from phalanx.shard.optim import HybridOptimizer, HybridZeroOptimizer
from phalanx.zero.optimizer import ZeroConfig


def scale_expert_grads(params, ep_size: int) -> None:
    """Divide every gradient contribution of the expert parameters by ep_size (module docstring);
    frozen ones (a LoRA base's experts) get none."""
    if ep_size > 1:
        for p in params:
            if p.requires_grad:
                p.register_hook(lambda g: g / ep_size)


def split_off_experts(optimizer: torch.optim.Optimizer, expert_ids: set[int]) -> torch.optim.Optimizer:
    """Move the expert parameters out of each of `optimizer`'s param groups into a new optimizer of
    the same class, one group per original group with the same hyper-parameters (a group may be
    left empty on either side)."""
    groups = []
    for group in optimizer.param_groups:
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": [p for p in group["params"] if id(p) in expert_ids]})
        group["params"] = [p for p in group["params"] if id(p) not in expert_ids]
    accepted = inspect.signature(type(optimizer).__init__).parameters  # AdamW's defaults hold more than it takes
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


class ExpertHybridOptimizer(HybridOptimizer):
    """zero_stage 0: expert gradients averaged over `expert_dp_group`, the others over dp."""

    def __init__(self, optimizer, *, expert_ids: set[int], expert_dp_group, **kwargs):
        super().__init__(optimizer, **kwargs)
        self.expert_ids, self.expert_dp_group = expert_ids, expert_dp_group

    def reduce_over_replicas(self, pairs) -> None:
        flat_all_reduce([g for p, g in pairs if id(p) not in self.expert_ids], self.dp_group, average=True,
                        name="dp.all_reduce_grads")
        flat_all_reduce([g for p, g in pairs if id(p) in self.expert_ids], self.expert_dp_group, average=True,
                        name="ep.all_reduce_expert_grads")


class _FollowedScale(DynamicLossScaler):
    """The experts' optimizer's loss scaler under fp16: the scale this step's gradients carry, set
    by `ExpertZeroOptimizer.step` from the dense optimizer's scaler, which alone backs off and grows
    (and is saved with the checkpoint)."""

    def update(self, overflow: bool) -> None:
        pass


class _ExpertShards(HybridZeroOptimizer):
    """The experts' ZeRO optimizer: its step uses the norm the dense optimizer computed over both."""

    shared_norm = 0.0

    def _global_norm(self, grads) -> float:
        return self.shared_norm


class ExpertZeroOptimizer(HybridZeroOptimizer):
    """zero_stage 1/2: the dense parameters' ZeRO optimizer (over data × sequence ranks, on the
    user's torch optimizer), driving the experts' (`experts`, over the expert data-parallel group,
    on a twin optimizer). The surface the Booster and the training loop use (`backward`, `step`,
    `zero_grad`, `no_sync`, `param_groups`, `last_grad_norm`) covers both."""

    def __init__(self, optimizer, config: ZeroConfig, *, expert_ids: set[int], expert_dp_group, names, weights,
                 partial: PartialGradSync, tp_group, process_group, precision=None):
        twin = split_off_experts(optimizer, expert_ids)
        self.experts = _ExpertShards(twin, config, names=names, process_group=expert_dp_group, weights=weights,
                                     partial=PartialGradSync([], tp_group), precision=precision)
        super().__init__(optimizer, config, names=names, process_group=process_group, weights=weights,
                         partial=partial, precision=precision)
        if self.scaler.enabled:  # fp16: the dense optimizer's scaler drives both (module docstring)
            self.experts.scaler = _FollowedScale(init_scale=self.scaler.scale)

    def _global_norm(self, grads) -> float:
        self.experts.reducer.finish()
        norm = weighted_norm(self.norm_pieces() + self.experts.norm_pieces(), self.device)
        self.experts.shared_norm = norm
        return norm

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self.experts.reducer.sync:
            self.experts.reducer.flush()

    def flush(self) -> None:
        """Launch every bucket of both optimizers (after a pipeline's microbatches)."""
        self.reducer.flush()
        self.experts.reducer.flush()

    def step(self, closure=None) -> None:
        for dense, twin in zip(self.optim.param_groups, self.experts.optim.param_groups):
            twin.update({k: v for k, v in dense.items() if k != "params"})  # an LR scheduler's changes
        scale = self.scaler.scale  # what this step's gradients carry (the dense step may change it)
        super().step(closure)
        if self.scaler.enabled:
            self.experts.scaler.scale = scale
        self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with super().no_sync(), self.experts.no_sync():
            yield

    def master_slots(self) -> dict[int, tuple]:
        return {**super().master_slots(), **self.experts.master_slots()}

    def load_master_weights(self, values: dict[int, torch.Tensor]) -> None:
        super().load_master_weights(values)
        self.experts.load_master_weights(values)
