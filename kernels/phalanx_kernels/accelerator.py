"""Which accelerator this process computes on: real CUDA, the emulated GPU, or none.

Every branch of phalanx that differs between a GPU and the CPU asks here instead of calling
`torch.cuda.is_available()` or comparing `device.type == "cuda"`, so the same branch runs on a
real GPU and under `PHALANX_EMULATE_GPU=1` (see `phalanx.emulate`). The emulated GPU is torch's
PrivateUse1 backend renamed `EMULATED_TYPE`: a CPU build of torch cannot give a tensor the device
type "cuda" and still run autograd on it (autograd asks the CUDA device guard, which a CPU build
does not link), so emulated device tensors say `emucuda:N` where a GPU's say `cuda:N`.
"""
from __future__ import annotations

from types import ModuleType

import torch

EMULATED_TYPE = "emucuda"


def emulated() -> bool:
    """True once `phalanx.emulate.install()` has registered the emulated GPU in this process."""
    return torch._C._get_privateuse1_backend_name() == EMULATED_TYPE


def accelerator_type() -> str | None:
    """"cuda" on a GPU machine, EMULATED_TYPE under emulation, None on a plain CPU run."""
    if emulated():
        return EMULATED_TYPE
    if torch.cuda.is_available():
        return "cuda"
    return None


def available() -> bool:
    return accelerator_type() is not None


def is_accelerator(x: torch.Tensor | torch.device | str | None) -> bool:
    """Whether a tensor or a device is on the accelerator (real or emulated)."""
    if x is None:
        return False
    device = x.device if isinstance(x, torch.Tensor) else torch.device(x)
    return device.type in ("cuda", EMULATED_TYPE)


def device_module(kind: str | torch.device | None = None) -> ModuleType:
    """`torch.cuda`, or the emulated GPU's module with the same functions (memory statistics,
    streams, events, synchronize, properties, RNG state)."""
    if kind is None:
        kind = accelerator_type() or "cuda"
    kind = kind.type if isinstance(kind, torch.device) else str(kind).split(":")[0]
    return getattr(torch, kind)


def current_device() -> torch.device:
    """The accelerator this process uses (after `launch`), else the CPU."""
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu")
    return torch.device(kind, device_module(kind).current_device())


def display(device: torch.device | str) -> str:
    """How a device is named to a user: the emulated GPU prints as "cuda:N (emulated)"."""
    device = torch.device(device)
    if device.type == EMULATED_TYPE:
        return f"cuda:{device.index if device.index is not None else 0} (emulated)"
    return str(device)


def accelerator_rng_fork(device: torch.device | None = None):
    """`torch.random.fork_rng` over the CPU and this process's accelerator (if any): the random
    streams after the block are those before it."""
    device = torch.device(device) if device is not None else current_device()
    if not is_accelerator(device):
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else device_module(device).current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def new_generator(device: torch.device | str) -> torch.Generator:
    """A random generator for sampling on `device`. The emulated GPU's device tensors take CPU
    generators (torch 2.13 gives a Python backend no way to make a device generator)."""
    device = torch.device(device)
    if device.type == EMULATED_TYPE:
        return torch.Generator()
    return torch.Generator(device=device)
