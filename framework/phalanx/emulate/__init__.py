"""Emulated GPU: run any phalanx command as on one CUDA GPU per rank while computing on the CPU.

`PHALANX_EMULATE_GPU=1` in the environment makes `import phalanx` call `install()`. See
docs/testing.md for what it catches and what it cannot.
"""
from __future__ import annotations

import os

import torch

from phalanx_kernels.accelerator import EMULATED_TYPE, emulated

from . import runtime

__all__ = ["install", "requested", "emulated", "SYNCS", "EMULATED_TYPE"]

SYNCS = runtime.SYNCS


def requested() -> bool:
    return os.environ.get("PHALANX_EMULATE_GPU", "").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Register the emulated GPU in this process (idempotent)."""
    if emulated():
        return
    if torch.cuda.is_available():
        raise RuntimeError("PHALANX_EMULATE_GPU=1 on a machine with a real GPU: unset it to use the GPU")
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from . import autocast, collectives, tensor

    # Triton kernels on emulated device tensors run in Triton's interpreter, which Triton selects
    # from this variable when a kernel is defined: asked for by PHALANX_EMULATE_GPU=1 itself.
    os.environ.setdefault("TRITON_INTERPRET", "1")

    _setup_privateuseone_for_python_backend(EMULATED_TYPE, backend_module=runtime.EmulatedDeviceModule())
    tensor.register_factories()
    autocast.register()
    torch.Tensor.pin_memory = tensor.pin_memory
    torch.Tensor.is_pinned = tensor.is_pinned
    tensor.patch_data_setter()
    tensor.patch_pinned_factories()
    runtime.patch_accelerator_streams()
    # transformers' hub kernels refuse devices they do not know (kernelize on `.train()`).
    os.environ.setdefault("USE_HUB_KERNELS", "0")
    collectives.install()
