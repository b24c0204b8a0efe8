"""Parallel layouts: each plugin wraps model, optimizer and data for one strategy."""
from __future__ import annotations

import importlib
from typing import Any

from phalanx.amp.precision import Precision
from phalanx.booster.plugins.base import Plugin

_PLUGINS = {
    "DDPPlugin": "phalanx.booster.plugins.ddp",
    "FSDPPlugin": "phalanx.booster.plugins.fsdp",
    "ZeroPlugin": "phalanx.booster.plugins.zero",
    "GeminiPlugin": "phalanx.booster.plugins.gemini",
    "HybridParallelPlugin": "phalanx.booster.plugins.hybrid",
}

__all__ = ["Plugin", "make_plugin", *_PLUGINS]


def __getattr__(name: str) -> Any:
    if name in _PLUGINS:
        return getattr(importlib.import_module(_PLUGINS[name]), name)
    raise AttributeError(f"module 'phalanx.booster.plugins' has no attribute {name!r}")


PLUGIN_NAMES = ("ddp", "fsdp", "zero1", "zero2", "gemini", "hybrid")
# Plugins whose data replicas can be groups of consecutive ranks (`Plugin.ranks_per_replica`): the
# ranks of a group split one sample (video's sequence-parallel groups, protein's DAP groups).
REPLICA_GROUP_PLUGINS = ("ddp", "zero1", "zero2", "fsdp", "gemini")
# Plugins that split parameters or optimizer state over ranks: a recipe builds its model on the meta
# device for them (`phalanx.lazy`) and the plugin materialises each rank's part; DDP gets it eagerly.
LAZY_BUILD_PLUGINS = ("fsdp", "zero1", "zero2", "gemini", "hybrid")


def builds_lazily(name: str | None, lora: bool = False) -> bool:
    """Whether a recipe with `train.plugin` = `name` should build its model on the meta device
    (with `lora`: adapters go on the lazy base, which every plugin here but Gemini reads lazily)."""
    key = (name or "").lower()
    return key in LAZY_BUILD_PLUGINS and not (lora and key == "gemini")


def make_plugin(name: str, precision: str | Precision = "fp32", max_norm: float | None = None, **kwargs: Any) -> Plugin:
    """Build a plugin from its config name: ddp | fsdp | zero1 | zero2 | gemini | hybrid (the last
    takes HybridParallelPlugin's keyword arguments: tp_size=..., sp_size=..., zero_stage=...).
    `precision`: a config name (the plugin resolves it once) or a resolved Precision."""
    key = name.lower()
    if key == "ddp":
        from phalanx.booster.plugins.ddp import DDPPlugin
        return DDPPlugin(precision=precision, max_norm=max_norm, **kwargs)
    if key == "fsdp":
        from phalanx.booster.plugins.fsdp import FSDPPlugin
        return FSDPPlugin(precision=precision, max_norm=max_norm, **kwargs)
    if key in ("zero1", "zero2"):
        from phalanx.booster.plugins.zero import ZeroPlugin
        return ZeroPlugin(stage=int(key[-1]), precision=precision, max_norm=max_norm, **kwargs)
    if key == "gemini":
        from phalanx.booster.plugins.gemini import GeminiPlugin
        return GeminiPlugin(precision=precision, max_norm=max_norm, **kwargs)
    if key == "hybrid":
        from phalanx.booster.plugins.hybrid import HybridParallelPlugin
        return HybridParallelPlugin(precision=precision, max_norm=max_norm, **kwargs)
    raise ValueError(f"unknown plugin {name!r}; choose one of {', '.join(PLUGIN_NAMES)}")
