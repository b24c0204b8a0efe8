"""Phalanx: one training engine for a laptop CPU and a GPU cluster.

Importing has no side effects: no environment variable is changed, no process group is made;
heavier submodules (train, checkpoint, …) load on first use. The one thing import reads is
`PHALANX_EMULATE_GPU=1`, which registers the emulated GPU (`phalanx.emulate`) before anything
chooses a device.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["launch", "shutdown", "DistContext", "__version__"]

from phalanx import emulate as _emulate  # noqa: E402

if _emulate.requested():
    _emulate.install()

# Eager on purpose: `phalanx.launch` must be the function, not the submodule of the same name.
from phalanx.launch import DistContext, launch, shutdown  # noqa: E402

_LAZY: dict[str, tuple[str, str]] = {}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in {"train", "booster", "config", "mesh", "checkpoint", "zero", "amp", "data", "observe", "inference",
                "gemini", "shard", "sequence", "lazy", "device"}:
        return importlib.import_module(f"phalanx.{name}")
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
