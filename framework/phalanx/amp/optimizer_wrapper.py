"""The torch.optim-like surface every plugin's optimizer shares.

Subclasses (mixed precision, FSDP, ZeRO, Gemini) set `optim` (the user's optimizer object, kept
so LR schedulers built on it keep working), `scaler`, `max_norm`, `last_grad_norm` and
`skipped`, and implement `step`.
"""
from __future__ import annotations

import torch

from phalanx.amp.loss_scaler import DynamicLossScaler
from phalanx.amp.precision import Precision, resolve_precision


class OptimizerWrapper:
    def __init__(self, optimizer: torch.optim.Optimizer, precision: str | Precision = "fp32",
                 max_norm: float | None = None):
        self.optim = optimizer
        self.precision = resolve_precision(precision)
        self.max_norm = max_norm
        self.scaler = DynamicLossScaler.for_precision(self.precision)
        self.last_grad_norm: float | None = None  # global norm over all shards, before clipping
        self.skipped = False  # the last step was skipped on fp16 overflow

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def state(self):
        return self.optim.state

    @property
    def defaults(self):
        return self.optim.defaults

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale_loss(loss).backward()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip every following step to `max_norm` (the clip happens inside `step`, after the
        gradients are reduced); returns the last step's norm."""
        self.max_norm = max_norm
        return self.last_grad_norm if self.last_grad_norm is not None else float("nan")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)
