"""Byte accounting for the tiers Gemini moves data between: "device", "host" and "disk".

Every tensor the chunk manager creates, moves or frees goes through `MemoryTiers`, which
records the bytes per tier and the device and host peaks, and refuses (with `BudgetExceeded`)
an allocation that would take the device tier over its budget, or the host tier over its own
(`host_budget`, when one is set); the placement policies plan with these numbers. The disk
tier (`phalanx.gemini.disk`) holds no tensors: its bytes are the chunk files' contents, counted
here so that the three tiers add up. A tensor with two roles (an fp32 chunk's shard that is also
its master) is counted once. The tiers are real places, on a CPU-only machine too: the host tier is
`phalanx.hostmem`'s pool (pinned memory on a GPU machine; shared anonymous pages, which the
kernel counts apart from torch's allocations, on a CPU-only one), and a move is a real copy. So
the budget can be checked against what the kernel reports (docs/gemini.md, "Memory, measured").
"""
from __future__ import annotations

import re

import torch

from phalanx_kernels.accelerator import device_module, is_accelerator

from phalanx.hostmem import host_copy, host_empty

DEVICE, HOST, DISK = "device", "host", "disk"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class BudgetExceeded(RuntimeError):
    """An allocation would take the device tier over its budget (an internal invariant: the
    placement policy must make room first)."""


def parse_bytes(value: str | int | float | None, default: int | None, what: str = "device_memory_budget") -> int | None:
    """'20GiB', '512MB', 1e9 or None (the default) -> a byte count."""
    if value is None:
        return None if default is None else int(default)
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"{what}={value} must be positive")
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read a memory size from {value!r}: write e.g. '20GiB', '512MB' or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def device_capacity(device: torch.device) -> int:
    """What the device has: the GPU's total memory, or the machine's RAM for a CPU "device"."""
    if is_accelerator(device):
        return device_module(device).get_device_properties(device).total_memory
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MemoryTiers:
    def __init__(self, device: torch.device, budget: int, host_budget: int | None = None):
        self.device = device
        self.budget = int(budget)
        self.host_budget = None if host_budget is None else int(host_budget)
        self.bytes = {DEVICE: 0, HOST: 0, DISK: 0}
        self.peak_device = 0
        self.peak_host = 0
        self.reserve = 0  # non-model bytes the policy expects at the current step (auto)
        self.peak_device_with_reserve = 0

    def free_device(self) -> int:
        """Device bytes still allowed, after the current non-model reserve."""
        return self.budget - self.reserve - self.bytes[DEVICE]

    def _add(self, tier: str, n: int) -> None:
        if tier == DEVICE and self.bytes[DEVICE] + n > self.budget:
            raise BudgetExceeded(f"device tier would hold {self.bytes[DEVICE] + n} bytes, budget {self.budget}")
        if tier == HOST and self.host_budget is not None and self.bytes[HOST] + n > self.host_budget:
            raise BudgetExceeded(f"host tier would hold {self.bytes[HOST] + n} bytes, budget {self.host_budget}")
        self.bytes[tier] += n
        if tier == HOST:
            self.peak_host = max(self.peak_host, self.bytes[HOST])
        if tier == DEVICE:
            self.peak_device = max(self.peak_device, self.bytes[DEVICE])
            self.note_reserve(self.reserve)

    def note_reserve(self, reserve: int) -> None:
        self.reserve = reserve
        self.peak_device_with_reserve = max(self.peak_device_with_reserve, self.bytes[DEVICE] + reserve)

    def empty(self, tier: str, numel: int, dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
        self._add(tier, numel * torch.empty((), dtype=dtype).element_size())
        if tier == HOST:
            return host_empty(numel, dtype, zero=zero, pinned=True)
        make = torch.zeros if zero else torch.empty
        return make(numel, dtype=dtype, device=self.device)

    def adopt(self, tier: str, t: torch.Tensor) -> torch.Tensor:
        """Count a tensor made elsewhere (autograd's gradient kept as a chunk's buffer) on `tier`."""
        self._add(tier, nbytes(t))
        return t

    def _copy_to(self, t: torch.Tensor, tier: str) -> torch.Tensor:
        if tier == HOST:
            return host_copy(t, pinned=True)
        return t.to(self.device, copy=True)

    def drop(self, tier: str, t: torch.Tensor | None) -> None:
        if t is not None:
            self.bytes[tier] -= nbytes(t)

    def copy(self, t: torch.Tensor, dst: str) -> torch.Tensor:
        """A copy of `t` on `dst` that leaves `t` (and its bytes) where it is: an fp32 master
        and its shard parting (phalanx.gemini.chunk). A tensor two roles share is counted once."""
        self._add(dst, nbytes(t))
        return self._copy_to(t, dst)

    def move(self, t: torch.Tensor, src: str, dst: str) -> torch.Tensor:
        if src == dst:
            return t
        self._add(dst, nbytes(t))
        self.bytes[src] -= nbytes(t)
        return self._copy_to(t, dst)
