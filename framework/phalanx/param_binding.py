"""Binding the user's optimizer to the parameters a plugin trains, by parameter name.

The optimizer is built on the user's model before boosting. Plugins name its parameters for
checkpoints (`optimizer_param_names`), and plugins that replace parameters while sharding
(FSDP2, tensor and pipeline parallelism) record every parameter's name first, then point the
optimizer's param groups at the new parameters of the same names (`rebind_optimizer_params`,
`phalanx.pipeline.params.rebind_to_stages`). Below the engines: plugins, `phalanx.pipeline` and
`phalanx.gemini` import it, and it imports nothing of phalanx.
"""
from __future__ import annotations

import torch
from torch import nn

FOREIGN_PARAM = ("the optimizer holds a parameter that is not in the model: build it from "
                 "model.parameters() of the model you pass to boost()")


def check_unstepped(optimizer: torch.optim.Optimizer) -> None:
    """Re-pointing param groups would orphan state keyed by the old parameters: refuse it."""
    if optimizer.state:
        raise ValueError("boost the model before the optimizer's first step (it already holds state)")


def optimizer_param_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[int, str]:
    """Map id(param) -> name in `model` (the unwrapped model), checking the optimizer holds only
    its parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        if any(id(p) not in names for p in group["params"]):
            raise ValueError(FOREIGN_PARAM)
    return names


def rebind_optimizer_params(optimizer: torch.optim.Optimizer, model: nn.Module,
                            names_before: dict[int, str]) -> dict[int, str]:
    """Point the optimizer at the parameters of `model` (the unwrapped model) that replaced the
    originals during sharding (matched by name) and return id(param) -> name for the new ones."""
    check_unstepped(optimizer)
    by_name = dict(model.named_parameters())
    for group in optimizer.param_groups:
        try:
            group["params"] = [by_name[names_before[id(p)]] for p in group["params"]]
        except KeyError as exc:
            raise ValueError(FOREIGN_PARAM) from exc
    return {id(p): n for n, p in by_name.items()}
