"""The model wrapper `Booster.boost` returns: calls go to the parallel module (DDP, FSDP, …),
`unwrapped` is the user's original model (for saving, generation, inspection)."""
from __future__ import annotations

from torch import nn


class ModelWrapper(nn.Module):
    def __init__(self, module: nn.Module, unwrapped: nn.Module):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_unwrapped", unwrapped)  # not a registered submodule: no double state

    @property
    def unwrapped(self) -> nn.Module:
        return self._unwrapped

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._unwrapped, name)  # e.g. model.config, model.generate
