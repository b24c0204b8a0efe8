"""Evaluation: how `fit` calls an `eval_fn`, and a ready-made one for causal LMs.

    fit(cfg, model, train_set, eval_fn=causal_lm_eval(val_set, batch_size=8))

`causal_lm_eval`: mean next-token loss and perplexity on held-out data. Each data replica
evaluates every dp-size-th batch and the sums are all-reduced, so the result is the
token-weighted mean over the whole eval set, whatever the number of ranks and the layout.

`eval_loss_sum(model, batch)` scores one batch under any plugin: the fused head loss for
data-parallel plugins, the model's own (vocabulary-parallel) loss for tensor/sequence-parallel
models, and a forward-only pass through the stages for pipelined ones (every rank of a pipeline calls
it with the same batch; each gets the batch's loss). `data_replica(model)` says which batches a
rank should take: tensor, sequence and pipeline peers must score the same ones.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, Mapping

import torch

from phalanx_kernels.accelerator import accelerator_rng_fork
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from phalanx.booster.state import boosted_state
from phalanx.train.data import default_collate
from phalanx.train.losses import (IGNORE_INDEX, causal_lm_labels, causal_lm_loss_sum, count_target_tokens,
                                  model_loss_sum, next_token_targets)


def causal_lm_eval(dataset: Any, batch_size: int = 8, collate_fn: Callable | None = None,
                   max_batches: int | None = None, ignore_index: int = IGNORE_INDEX
                   ) -> Callable[[nn.Module, int], dict[str, float]]:
    """An eval_fn(model, step) -> {"loss": mean token loss, "ppl": exp(loss), "tokens": count}."""
    if len(dataset) == 0:
        raise ValueError("the eval dataset is empty: check its path and preprocessing")
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn or default_collate)

    @torch.no_grad()
    def eval_fn(model: nn.Module, step: int) -> dict[str, float]:
        replica, replicas = data_replica(model)
        world = dist.get_world_size() if dist.is_initialized() else 1
        device = next(model.parameters()).device
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for i, batch in enumerate(loader):
            if max_batches is not None and i >= max_batches:
                break
            if i % replicas != replica:
                continue
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            totals[0] += eval_loss_sum(model, batch, ignore_index=ignore_index).double()
            totals[1] += (next_token_targets(batch, ignore_index) != ignore_index).sum()
        if world > 1:
            dist.all_reduce(totals)
            totals /= world // replicas  # every rank of a replica counted the same batches
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": float(totals[1].item())}

    return eval_fn


def data_replica(model: nn.Module) -> tuple[int, int]:
    """(this rank's data replica, number of replicas): the data-parallel rank and size of the
    plugin that boosted `model` (tensor, sequence and pipeline peers are one replica), the global
    rank and world size otherwise."""
    state = boosted_state(model)
    if state is not None:
        return state.data_replica
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def eval_loss_sum(model: nn.Module, batch: Mapping[str, Any], *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of the batch's next-token losses (fp32 scalar) under the user's (boosted) causal LM,
    whatever the plugin (see the module doc). Padding: an attention_mask with zeros only at the
    end of rows (right padding) is turned into ignored labels for a pipeline."""
    state = boosted_state(model)
    if state is None or not state.model_computes_loss:
        return causal_lm_loss_sum(model, batch, ignore_index=ignore_index)
    targets = count_target_tokens(batch, ignore_index)
    if targets == 0:  # the same batch on every peer, so all of them skip it together
        return torch.zeros((), dtype=torch.float32, device=batch["input_ids"].device)
    runner = state.pipeline
    if runner is None:
        return model_loss_sum(state.module, batch, targets).float()
    mask = batch.get("attention_mask")
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError("a pipeline evaluates without an attention_mask, so padding must be at the end of rows "
                         "(right padding, ignored through the labels); this batch has padding before real tokens")
    return runner.evaluate(batch["input_ids"], causal_lm_labels(batch, ignore_index))["loss"].float() * targets


@contextlib.contextmanager
def eval_mode(boosted: nn.Module, model: nn.Module) -> Iterator[None]:
    """The user's model in eval mode, under no_grad, with FSDP's root parameters gathered (the
    blocks gather their own), and the training RNG streams untouched by whatever eval samples."""
    root = getattr(boosted, "module", None)
    unshard = getattr(root, "unshard", None) if _is_fsdp(root) else None
    was_training = model.training
    model.eval()
    with accelerator_rng_fork():
        try:
            if unshard is not None:
                unshard()
            with torch.no_grad():
                yield
        finally:
            if unshard is not None:
                root.reshard()
            model.train(was_training)


def _is_fsdp(module: Any) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - every supported torch has it
        return False
    return isinstance(module, FSDPModule)


def eval_results(result: Any, step: int) -> dict[str, float]:
    if not isinstance(result, Mapping):
        raise TypeError(f"eval_fn must return a dict of numbers, got {type(result).__name__} at step {step}")
    out = {}
    for key, value in result.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, (int, float)):
            out[str(key)] = float(value)
    return out
