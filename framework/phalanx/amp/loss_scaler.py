"""Dynamic loss scaling for fp16: grow the scale while steps are finite, halve and skip the
step on overflow. The overflow decision is agreed across ranks so every rank skips together.

A `DynamicLossScaler` is the only holder of the scaling state (scale, steps since the last
overflow, skipped steps): every phalanx optimizer has one as `.scaler`, and the Booster saves
its `state_dict()` with the optimizer's checkpoint (nowhere else)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
import torch.distributed as dist

from phalanx_kernels.accelerator import current_device

if TYPE_CHECKING:
    from phalanx.amp.precision import Precision


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, min_scale: float = 1.0, max_scale: float = 2.0**24,
                 enabled: bool = True):
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.max_scale = max_scale
        self.enabled = enabled
        self.good_steps = 0
        self.skipped_steps = 0

    @classmethod
    def for_precision(cls, precision: "Precision", **kwargs) -> "DynamicLossScaler":
        """A scaler that is enabled exactly when `precision` needs loss scaling (fp16)."""
        return cls(enabled=precision.loss_scaling, **kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @staticmethod
    def found_inf(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """True if any tensor on any rank of `group` holds inf/nan."""
        tensors = [t for t in tensors if t is not None]
        device = tensors[0].device if tensors else current_device()  # NCCL takes no CPU flag
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        if tensors:  # checked on the device, answered with one host sync (not one per tensor)
            finite = torch.stack([torch.isfinite(t).all().to(device) for t in tensors]).all()
            flag.copy_((~finite).float().reshape(1))
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def unscale_or_skip(self, grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> bool:
        """For optimizers that test the gradients themselves: False, after backing off, when any
        rank of `group` holds a non-finite gradient (skip the step); else divide `grads` in place
        by the scale and return True. A disabled scaler only returns True."""
        if not self.enabled:
            return True
        if self.found_inf(grads, group):
            self.update(True)
            return False
        inv = 1.0 / self.scale
        for g in grads:
            g.mul_(inv)
        return True

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            self.good_steps = 0
            self.skipped_steps += 1
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale = min(self.max_scale, self.scale * self.growth_factor)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_steps": self.skipped_steps,
                "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
