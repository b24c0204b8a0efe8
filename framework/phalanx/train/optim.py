"""AdamW with decay on matrices only, and the warm-up + cosine learning-rate schedule.

The schedule is a `LambdaLR` on the *original* optimizer, built before `Booster.boost`: the
plugins keep that optimizer's param-group dicts, so the scheduler's learning rate reaches
whatever the plugin steps (fp32 masters, shards). Its state (just the step counter) is saved in
the checkpoint; the lambda itself is rebuilt from the config.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from phalanx.train.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weight matrices and embeddings (decayed) and 1-D parameters -- norms, biases --
    (never decayed: shrinking a norm's gain or a bias toward zero is not regularisation)."""
    decay, no_decay = [], []
    for p in model.parameters():  # unique parameters: tied weights appear once
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False)")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)


def warmup_cosine(step: int, *, warmup_steps: int, decay_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier for the optimizer step that follows `step` completed steps.

    Warm-up: (step + 1) / (warmup_steps + 1), so the very first step already moves. Then a
    cosine from 1 at `warmup_steps` to `min_lr_ratio` at `decay_steps`, constant afterwards."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if step >= decay_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, decay, floor = cfg.warmup_steps, cfg.lr_decay_steps, cfg.min_lr_ratio

    # A plain function, not a functools.partial: LambdaLR saves a callable object's __dict__ in
    # its state, and a checkpoint must hold only the step counter.
    def schedule(step: int) -> float:
        return warmup_cosine(step, warmup_steps=warmup, decay_steps=decay, min_lr_ratio=floor)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
