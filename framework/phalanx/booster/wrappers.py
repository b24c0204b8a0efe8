"""The model wrapper `Booster.boost` returns: calls go to the parallel module (DDP, FSDP, …),
`unwrapped` is the user's original model (for saving, generation, inspection)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class GradForwards:
    """Forwards with gradients since the last backward: a backward with none means the loss was
    computed past the parallel module (see `phalanx.booster.plugins.base.check_forward_went_through`)."""

    count: int = 0

    def take(self) -> int:
        """The count so far, and start again from zero."""
        count, self.count = self.count, 0
        return count


class ModelWrapper(nn.Module):
    def __init__(self, module: nn.Module, unwrapped: nn.Module):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_unwrapped", unwrapped)  # not a registered submodule: no double state
        self.grad_forwards = GradForwards()

    @property
    def unwrapped(self) -> nn.Module:
        return self._unwrapped

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled():
            self.grad_forwards.count += 1
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._unwrapped, name)  # e.g. model.config, model.generate
