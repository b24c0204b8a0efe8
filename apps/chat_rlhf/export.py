"""The trained policy as a plain Hugging Face model directory, whatever the run trained around it.

GRPO trains the causal LM itself, so each checkpoint's `model/` already is the policy. PPO trains
an actor-critic wrapper whose `model/` holds `actor.*`, `critic.*` and `value_head.*` (what a
resume needs, and what no other tool can open); `PolicyExport`, a `fit` hook, therefore writes
`policy/` beside it in every checkpoint: the actor alone, under its Hugging Face names, with its
`config.json`, `generation_config.json` and the tokenizer. `from_pretrained`, the recipe's `chat`
and `evaluate` and `phalanx serve` open it; `models.resolve_model_dir` finds it from a checkpoint or
an output_dir.

The weights come from the plugin's own gather (`iter_full_model_state`: fp32 masters where the
optimizer keeps them, FSDP2 / ZeRO shards and tensor-parallel splits made whole), one tensor at a
time, and rank 0 writes them as they come (`phalanx.checkpoint.hf.save_hf_model`), so no rank holds
a second copy of the model. A model that no plugin boosted is read from its state dict.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

POLICY_DIR = "policy"


def policy_tensors(model: nn.Module, submodule: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name inside the policy, full CPU tensor) for every tensor of `submodule` of the (boosted or
    plain) `model`; "" for the model itself. A collective under a plugin that shards: every rank
    must walk it to the end."""
    from phalanx.booster.state import boosted_state
    state = boosted_state(model)
    pairs = state.plugin.iter_full_model_state(state.module) if state is not None else \
        ((k, v.detach().cpu()) for k, v in model.state_dict().items())
    yield from inside(pairs, submodule)


def inside(pairs: Iterable[tuple[str, torch.Tensor]], submodule: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """The pairs of `submodule` (a single module name, e.g. `actor`), named inside it whatever
    prefixes come before it; all of them when `submodule` is ""."""
    for name, tensor in pairs:
        if not submodule:
            yield name, tensor
            continue
        parts = name.split(".")
        if submodule in parts:
            yield ".".join(parts[parts.index(submodule) + 1:]), tensor


def export_policy(model: nn.Module, policy: nn.Module, directory: str | Path, *, submodule: str = "",
                  tokenizer: Any = None) -> Path:
    """Write the policy (`submodule` of the trained `model`; `policy` is that module, unwrapped,
    whose config is saved) into `directory` as a Hugging Face model directory. Every rank calls;
    rank 0 writes."""
    from phalanx.checkpoint.hf import save_hf_model
    directory = Path(directory)
    writer = not dist.is_initialized() or dist.get_rank() == 0
    pairs = policy_tensors(model, submodule)
    if writer:
        save_hf_model(policy, pairs, directory, tokenizer=tokenizer)
    else:
        for _ in pairs:  # join the gather's collectives
            pass
    return directory


class PolicyExport:
    """fit hook: `policy/` in every checkpoint (the module docstring). Holds no training state:
    loading a checkpoint reads nothing from it."""

    name = POLICY_DIR

    def __init__(self, policy: nn.Module, tokenizer: Any, submodule: str = "") -> None:
        self.policy, self.tokenizer, self.submodule = policy, tokenizer, submodule
        self.model: nn.Module | None = None

    def bind(self, model: nn.Module) -> None:
        self.model = model

    def after_step(self, step: int) -> None:
        pass

    def save(self, directory: Path) -> None:
        export_policy(self.model, self.policy, directory, submodule=self.submodule, tokenizer=self.tokenizer)

    def load(self, directory: Path) -> None:
        pass
