"""One optimizer step's forward and backward passes, and what they are worth (loss, tokens,
FLOPs) summed over the data-parallel ranks. The normalisation is explained in `loop.py`.

Three ways to get the causal-LM loss (`loss_fn is None`), all token-weighted over the global batch:
the `CausalLMLoss` wrapper (fused head + cross-entropy) for the data-parallel plugins; the model's
own forward with labels for a tensor/sequence-parallel model, whose plugin installs a
vocabulary-parallel `loss_function`; and `booster.execute_pipeline` for a pipelined one.
Ranks that hold the same data (tensor, sequence and pipeline peers) count it once: world-wide sums
are divided by `world_size / dp_size`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster import Booster
from phalanx.booster.state import boosted_state
from phalanx.observe import causal_lm_flops_per_token
from phalanx.watchdog import track
from phalanx.train.losses import IGNORE_INDEX, causal_lm_labels, count_target_tokens, model_loss_sum

LossFn = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]
StepFlops = Callable[[list], float]


def train_step(booster: Booster, model: nn.Module, optimizer: Any, micro: list[dict], loss_fn: LossFn | None,
               dp_size: int, step_flops: StepFlops | None, device: torch.device, *,
               model_computes_loss: bool = False) -> tuple[float, int, float | None]:
    """Forward and backward over the micro-batches; returns (global loss, global tokens, global
    model FLOPs). Gradient synchronisation runs only with the last micro-batch.

    model_computes_loss: the boosted model is the Hugging Face model itself, whose forward with
    `labels` returns the mean token loss (the hybrid plugin's vocabulary-parallel loss)."""
    replicas = dist.get_world_size() // dp_size
    if loss_fn is None:
        targets = [count_target_tokens(b, IGNORE_INDEX) for b in micro]  # counted once per micro-batch
        local_targets = sum(targets)
        with track("target-token all-reduce"):
            global_targets = all_reduce_sum([float(local_targets)], device)[0] / replicas
        if global_targets == 0:
            raise ValueError("every label of this step's global batch is ignore_index (-100): the data has no "
                             "target tokens; check the labels / attention_mask produced by the dataset")
        scale, denominator = dp_size / global_targets, global_targets
    else:
        scale, denominator = 1.0 / len(micro), float(len(micro) * dp_size)

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    state = boosted_state(model)
    if state is not None and state.pipeline is not None:
        with track("pipeline schedule"):
            loss_sum += _pipeline_loss_sum(booster, model, optimizer, micro, targets, scale)
    else:
        for i, batch in enumerate(micro):
            sync = booster.no_sync(model, optimizer) if i < len(micro) - 1 else contextlib.nullcontext()
            with sync:
                with track("forward"):
                    if loss_fn is not None:
                        raw = loss_fn(model, batch)
                    elif model_computes_loss:
                        raw = model_loss_sum(model, batch, targets[i])
                    else:
                        raw = model(**batch)
                if not isinstance(raw, torch.Tensor) or raw.dim() != 0:
                    raise TypeError(f"the loss must be a scalar tensor, got {type(raw).__name__} "
                                    f"{tuple(raw.shape) if isinstance(raw, torch.Tensor) else ''}")
                with track("backward + gradient all-reduce" if i == len(micro) - 1 else "backward"):
                    booster.backward(raw * scale, optimizer)
            loss_sum += raw.detach().double()

    local_tokens = sum(tokens_in(b) for b in micro)
    local_flops = step_flops(micro) if step_flops is not None else 0.0
    with track("loss all-reduce"):
        total_loss, tokens, flops = (v / replicas for v in all_reduce_sum([loss_sum, float(local_tokens),
                                                                           local_flops], device))
    return total_loss / denominator, int(round(tokens)), (flops if step_flops is not None else None)


def _pipeline_loss_sum(booster: Booster, model: nn.Module, optimizer: Any, micro: list[dict], targets: list[int],
                       scale: float) -> torch.Tensor:
    """One `execute_pipeline` for the step (the schedule splits it into its own microbatches).

    The pipeline's loss is this rank's token mean; weighting its gradient by local tokens x
    `scale` (= dp / global tokens) makes the data-parallel average the global token mean."""
    (batch,) = micro  # fit refused grad_accum_steps > 1 and loss_fn with a pipeline (loop._check_pipeline_options)
    (tokens,) = targets
    pipeline_batch = {"input_ids": batch["input_ids"], "labels": causal_lm_labels(batch)}
    out = booster.execute_pipeline(iter([pipeline_batch]), model, None, optimizer, loss_weight=scale * tokens)
    return out["loss"].detach().double() * tokens


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
