"""CPU offload for the ZeRO optimizer: the host store of the fp32 master shards, their gradients
and the optimizer state, and the bytes that cross between the device and the host.

Per optimizer step, and only here: each reduced gradient piece goes device→host once, in the
communication dtype (half the bytes for bf16/fp16), and is widened and added into the fp32
gradient shard on the host; the optimizer runs there; the updated shard goes host→device once,
cast to the model dtype, and is all-gathered into the model's parameters. `traffic` counts both
directions, so a run can show what it moved.

The memory is `phalanx.hostmem`'s: pinned CPU memory on a GPU machine, and on a CPU-only one a
pool of its own (shared pages the kernel counts apart from torch's allocations) with real
copies in and out, so that the offload path is observable where there is no GPU. The
optimizer state, which the torch optimizer creates beside the master shard, is moved into the
pool after a step on a CPU-only machine (on a GPU machine it is already in CPU memory, and
pinning it would only take page-locked memory the copies never use).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from phalanx.hostmem import host_copy, host_empty, in_host_pool


@dataclass
class Traffic:
    """Bytes moved since the optimizer was built."""

    to_host: int = 0  # reduced gradients, device -> host
    to_device: int = 0  # updated master shards, host -> device


class HostStore:
    def __init__(self):
        self.traffic = Traffic()

    def empty(self, numel: int) -> torch.Tensor:
        """A zeroed fp32 buffer on the host (pinned on a GPU machine: it is copied every step)."""
        return host_empty(numel, torch.float32, zero=True, pinned=True)

    def add_to(self, target: torch.Tensor, values: torch.Tensor) -> None:
        """target (host, fp32) += values (device, communication dtype): the one device→host copy."""
        self.traffic.to_host += values.numel() * values.element_size()
        target.add_(values.to("cpu").float())

    def to_device(self, master: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """A copy of the host shard on `device` in the model dtype: the one host→device copy."""
        out = torch.empty(master.numel(), dtype=dtype, device=device)
        out.copy_(master)
        self.traffic.to_device += out.numel() * out.element_size()
        return out

    def adopt_state(self, state: dict) -> None:
        """Move the optimizer state tensors that are not in host memory there (see the module
        docstring); scalars (Adam's step) stay as they are."""
        for per_param in state.values():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and not in_host_pool(value):
                    per_param[key] = host_copy(value).view(value.shape)
