"""What `fit` does when the training loss is NaN or infinite (`TrainConfig.on_nonfinite`).

- "stop" (the default): raise `NonFiniteLossError` before the step changes any weight;
- "skip": drop that step's gradients and go on with the next batch;
- "rollback": reload the last complete checkpoint (weights, optimizer, schedule, data position,
  RNGs) and continue from there with the learning rate multiplied by `rollback_lr_factor`.

Both "skip" and "rollback" stop with `NonFiniteLossError` once they have acted `max_nonfinite`
times in one run: a run that keeps diverging is broken, not unlucky. Every action is logged (a
warning and a metrics.jsonl record with `event`).
"""
from __future__ import annotations

from typing import Any

import torch

from phalanx.train.config import TrainConfig


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; raised before that step changes anything."""


class NonFinitePolicy:
    def __init__(self, cfg: TrainConfig, lr_scale: float = 1.0):
        self.mode = cfg.on_nonfinite
        self.limit = cfg.max_nonfinite
        self.factor = cfg.rollback_lr_factor
        self.count = 0            # skips or rollbacks so far in this run
        self.lr_scale = lr_scale  # product of the rollback factors applied so far (saved in checkpoints)

    def decide(self, message: str) -> str:
        """'skip' or 'rollback', or raise NonFiniteLossError(message) when stopping."""
        if self.mode == "stop":
            raise NonFiniteLossError(message)
        if self.count >= self.limit:
            raise NonFiniteLossError(f"{message} [on_nonfinite={self.mode!r} already acted {self.count} times, "
                                     f"the limit max_nonfinite={self.limit}]")
        self.count += 1
        return self.mode

    def scale_lr(self, scheduler: Any, optimizer: torch.optim.Optimizer, restored_scale: float) -> None:
        """After reloading a checkpoint saved at `restored_scale`: bring the schedule's base rates
        (saved with the scheduler, so a later resume keeps them) and the current rates to the new
        scale, this run's scale times `rollback_lr_factor`."""
        self.lr_scale *= self.factor
        ratio = self.lr_scale / restored_scale
        scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
        for group in optimizer.param_groups:
            group["lr"] *= ratio
