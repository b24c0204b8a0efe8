"""One optimizer step's forward and backward passes, and what they are worth (loss, tokens,
FLOPs) summed over the data-parallel ranks. The normalisation is explained in `loop.py`."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster import Booster
from phalanx.observe import causal_lm_flops_per_token
from phalanx.train.losses import IGNORE_INDEX, count_target_tokens

LossFn = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]
StepFlops = Callable[[list], float]


def train_step(booster: Booster, model: nn.Module, optimizer: Any, micro: list[dict], loss_fn: LossFn | None,
               dp_size: int, step_flops: StepFlops | None, device: torch.device) -> tuple[float, int, float | None]:
    """Forward and backward over the micro-batches; returns (global loss, global tokens, global
    model FLOPs). Gradient synchronisation runs only with the last micro-batch."""
    if loss_fn is None:
        local_targets = sum(count_target_tokens(b, IGNORE_INDEX) for b in micro)
        global_targets = all_reduce_sum([float(local_targets)], device)[0]
        if global_targets == 0:
            raise ValueError("every label of this step's global batch is ignore_index (-100): the data has no "
                             "target tokens; check the labels / attention_mask produced by the dataset")
        scale, denominator = dp_size / global_targets, global_targets
    else:
        scale, denominator = 1.0 / len(micro), float(len(micro) * dp_size)

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(micro):
        sync = booster.no_sync(model, optimizer) if i < len(micro) - 1 else contextlib.nullcontext()
        with sync:
            raw = model(**batch) if loss_fn is None else loss_fn(model, batch)
            if not isinstance(raw, torch.Tensor) or raw.dim() != 0:
                raise TypeError(f"the loss must be a scalar tensor, got {type(raw).__name__} "
                                f"{tuple(raw.shape) if isinstance(raw, torch.Tensor) else ''}")
            booster.backward(raw * scale, optimizer)
        loss_sum += raw.detach().double()

    local_tokens = sum(tokens_in(b) for b in micro)
    local_flops = step_flops(micro) if step_flops is not None else 0.0
    total_loss, tokens, flops = all_reduce_sum([loss_sum, float(local_tokens), local_flops], device)
    return total_loss / denominator, int(tokens), (flops if step_flops is not None else None)


def all_reduce_sum(values: list, device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks in one collective (a NaN on any rank reaches every rank,
    so all of them stop together)."""
    packed = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if dist.get_world_size() > 1:
        dist.all_reduce(packed)
    return packed.tolist()


def tokens_in(batch: Mapping[str, Any]) -> int:
    """Tokens for the throughput meter: input_ids elements, else samples."""
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() else 1


def step_flops_estimator(model: nn.Module, flops_per_token: float | None) -> StepFlops | None:
    """Model FLOPs of a rank's micro-batches: tokens x (6N + attention term at their length).

    N is counted here, on the unwrapped model before any sharding."""
    if flops_per_token is not None:
        return lambda micro: float(sum(tokens_in(b) for b in micro)) * flops_per_token
    try:
        base = causal_lm_flops_per_token(model, 0)
        per_position = causal_lm_flops_per_token(model, 1) - base
    except (ValueError, AttributeError, TypeError):
        return None  # not a transformer we can read: tokens/s only, no MFU

    def estimate(micro: list[dict]) -> float:
        total = 0.0
        for b in micro:
            ids = b.get("input_ids")
            if not isinstance(ids, torch.Tensor):
                return 0.0
            total += ids.numel() * (base + per_position * ids.shape[-1])
        return total

    return estimate
