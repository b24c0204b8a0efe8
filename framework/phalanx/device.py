"""The run's device, seen the same way on a GPU, under the emulated GPU and on a CPU.

`to_device` is the one helper that moves a batch (nested dicts, lists, tuples and dataclasses of
tensors) to the run's device: every training step, evaluation, reference pass and sampling loop in
phalanx and its recipes uses it, so a batch is never left on the host. The rest re-exports the
accelerator queries of `phalanx_kernels.accelerator` (the layer below) for framework and app code.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from phalanx_kernels.accelerator import (  # noqa: F401 - re-exported
    EMULATED_TYPE, accelerator_type, available, current_device, device_module, display, emulated, is_accelerator,
)


def run_device() -> torch.device:
    """The device of this rank's run (`launch` chose it), launching a one-rank group if needed."""
    from phalanx.launch import context

    return context().device


def to_device(batch: Any, device: torch.device | str | None = None, *, non_blocking: bool = True) -> Any:
    """`batch` with every tensor in it on `device` (default: the run's device). Containers are
    rebuilt with the same type; anything that is not a tensor is returned as it is."""
    device = torch.device(device) if device is not None else run_device()
    return _move(batch, device, non_blocking)


def _move(value: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking and is_accelerator(device))
    if isinstance(value, Mapping):
        moved = {k: _move(v, device, non_blocking) for k, v in value.items()}
        try:
            return type(value)(moved)  # dict, OrderedDict, transformers' BatchEncoding, ...
        except TypeError:  # a mapping type not built from a dict (e.g. defaultdict): a plain dict
            return moved
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_move(v, device, non_blocking) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device, non_blocking) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _move(getattr(value, f.name), device, non_blocking)
                                             for f in dataclasses.fields(value) if f.init})
    return value

