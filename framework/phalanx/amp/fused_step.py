"""Run the user's torch optimizer with torch's fused kernel over large flat tensors.

ZeRO gives the optimizer one contiguous fp32 shard per param group (millions of elements). For
CPU tensors torch's default is the single-tensor loop, which for Adam is about eight elementwise
passes over the shard, several of them allocating a temporary the size of the shard. Adam, AdamW,
SGD and Adagrad also ship a fused kernel (one vectorised pass over parameter, gradient and state)
on CPU and CUDA that computes the same update up to rounding. On the 21M-parameter Llama of
issue 21 it made the optimizer phase several times cheaper (docs/zero.md).

It lives in `amp`, below `zero`, because every optimizer wrapper steps through it: ZeRO's
shards, FSDP's DTensors and the one-process `MixedPrecisionOptimizer`.

The kernel is switched on only for the duration of `step` (`fused_kernels`), so the param groups
the user, the LR scheduler and checkpoints see keep the user's `fused`/`foreach` values, and a
checkpoint written here loads into any plugin unchanged. `fused_step` also applies the gradient
clipping factor inside the kernel (its `grad_scale` input divides each gradient as the kernel
reads it, the input torch's GradScaler uses to unscale), which saves the separate pass that
scales every gradient in place. Groups where the user chose a kernel
(`fused` or `foreach` not None), asked for `differentiable` or `capturable`, or optimizers that
are not exactly one of these classes (a subclass may override `step`) keep the user's choice.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

Kinds = tuple[type[torch.optim.Optimizer], ...]
FUSED_OPTIMIZERS: Kinds = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)
# DTensor (FSDP2's parameters) implements the fused kernel of these only.
DTENSOR_FUSED_OPTIMIZERS: Kinds = (torch.optim.Adam, torch.optim.AdamW)


def _fused_devices() -> set[str]:
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
        return set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - older torch
        return {"cuda", "cpu"}


def fusable(optimizer: torch.optim.Optimizer, group: dict, device: torch.device,
            kinds: Kinds = FUSED_OPTIMIZERS) -> bool:
    """Whether `group`'s step may run with the fused kernel on tensors on `device`."""
    if type(optimizer) not in kinds or "fused" not in group:
        return False
    if group.get("fused") is not None or group.get("foreach") is not None:
        return False  # the user chose an implementation: keep it
    if group.get("differentiable") or group.get("capturable"):
        return False
    return device.type in _fused_devices()


def step_device_for(optimizer: torch.optim.Optimizer, group: dict, device: torch.device,
                    kinds: Kinds = FUSED_OPTIMIZERS) -> torch.device:
    """Where the group's scalar `step` state must live: on the parameters' device when the step
    runs fused or capturable (the kernel reads it there), else on the CPU (torch's default)."""
    if fusable(optimizer, group, device, kinds) or group.get("capturable") or group.get("fused"):
        return device
    return torch.device("cpu")


@contextlib.contextmanager
def fused_kernels(optimizer: torch.optim.Optimizer, device: torch.device,
                  kinds: Kinds = FUSED_OPTIMIZERS) -> Iterator[None]:
    """Inside: the groups of `optimizer` that `fusable` accepts step with `fused=True`."""
    switched = [g for g in optimizer.param_groups if g["params"] and fusable(optimizer, g, device, kinds)]
    for group in switched:
        group["fused"] = True
    try:
        yield
    finally:
        for group in switched:
            group["fused"] = None


def _all_fused(optimizer: torch.optim.Optimizer) -> bool:
    groups = [g for g in optimizer.param_groups if g["params"]]
    return bool(groups) and all(g.get("fused") for g in groups)


@contextlib.contextmanager
def fused_step(optimizer: torch.optim.Optimizer, device: torch.device, grads: Sequence[torch.Tensor],
               clip: float = 1.0, kinds: Kinds = FUSED_OPTIMIZERS) -> Iterator[None]:
    """`fused_kernels`, with the gradients multiplied by `clip` (a clipping factor <= 1) for the
    step inside: by the fused kernel itself when every group steps fused (`grad_scale` =
    1 / clip, set on the optimizer only for the step), else by scaling `grads` in place first.
    An optimizer that already carries a `grad_scale` (a user's GradScaler) is never touched."""
    with fused_kernels(optimizer, device, kinds):
        in_kernel = (clip < 1.0 and _all_fused(optimizer) and getattr(optimizer, "grad_scale", None) is None
                     and getattr(optimizer, "found_inf", None) is None)
        if in_kernel:
            optimizer.grad_scale = torch.tensor(1.0 / clip, dtype=torch.float32, device=device)
        else:
            from phalanx.amp.clip import clip_grads  # here: phalanx.amp imports this module

            clip_grads(grads, clip)
        try:
            yield
        finally:
            if in_kernel:
                del optimizer.grad_scale
