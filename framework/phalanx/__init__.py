"""Phalanx: one training engine for a laptop CPU and a GPU cluster.

Import is cheap and has no side effects: submodules load on first use and no environment
variable is changed by importing.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

__all__ = ["launch", "DistContext", "train", "__version__"]

_LAZY = {
    "launch": ("phalanx.launch", "launch"),
    "DistContext": ("phalanx.launch", "DistContext"),
    "shutdown": ("phalanx.launch", "shutdown"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in {"train", "booster", "config", "mesh", "checkpoint", "zero", "amp", "data", "observe"}:
        return importlib.import_module(f"phalanx.{name}")
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
