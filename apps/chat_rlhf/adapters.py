"""LoRA for every algorithm of the recipe (SFT, reward model, DPO family, GRPO), and activation
checkpointing, through the framework's pieces.

    python -m apps.chat_rlhf.grpo --config apps/chat_rlhf/configs/grpo_arithmetic.yaml lora.enabled=true
    python -m apps.chat_rlhf.adapters runs/chat_rlhf/grpo --merge --out runs/chat_rlhf/grpo-merged

- The adapters come from `phalanx.booster.lora.enable_lora` (PEFT underneath, base frozen, only the
  adapters in the optimizer and the plugin's buckets/shards) from the config's `lora:` section (the
  LLaMA recipe's field names: enabled, rank, alpha, dropout, target_modules, merge).
- The reference policy of KL and DPO is the trained model itself with its adapter switched off
  (`DisabledAdapter`, peft's `disable_adapter()`): no second copy of the base is made.
- The rollout engine receives merged weights: W + (alpha/r)·B·A computed per sync, one tensor at a
  time, into the engine's own copy (`merged_engine_weights`); the trainer's base is never modified.
- Every checkpoint holds `adapter/` (PEFT's format: `peft.PeftModel.from_pretrained(base, dir)`) and,
  with `lora.merge`, `policy/` (the merged model as a plain Hugging Face directory, which later stages,
  `chat`, `evaluate` and `phalanx serve` find first). `python -m apps.chat_rlhf.adapters DIR --merge`
  merges an adapter afterwards with peft's own `merge_and_unload`.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from phalanx.booster.lora import LoRASection, with_lora
from phalanx.config import ConfigError

from .export import POLICY_DIR, PolicyExport, inside

ADAPTER_DIR, MERGED_DIR = "adapter", POLICY_DIR  # inside every checkpoint of a LoRA run


@dataclass
class LoRASettings(LoRASection):
    """LoRA adapters instead of full fine-tuning (the LLaMA recipe's `lora:` fields, docs/lora.md);
    `merge` also writes the merged model as policy/ in every checkpoint."""

    def validate(self, train_layers: int = 0) -> None:
        super().validate()
        if self.enabled and train_layers:
            raise ConfigError(f"lora.enabled with train_layers={train_layers}: LoRA already trains the adapters alone "
                              "(the base is frozen); set train_layers=0")


def is_lora(model: Any) -> bool:
    from phalanx.booster.lora import is_lora_model
    return is_lora_model(model)


def activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute each decoder layer in backward (transformers' gradient checkpointing, non-reentrant,
    so frozen inputs need no `requires_grad` and any plugin's forward runs it unchanged). Call it on
    the model before `fit` boosts it."""
    if not enabled:
        return
    from phalanx.booster.plugins.base import unwrap_model
    inner = unwrap_model(model)
    inner = inner.get_base_model() if is_lora(inner) else inner
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise ConfigError(f"activation_checkpointing: {type(inner).__name__} does not support gradient checkpointing")
    inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class DisabledAdapter:
    """The reference policy of a LoRA run: the trained model called with its adapter switched off
    (peft's `disable_adapter()`), i.e. the frozen base, sharing its weights. `bind(boosted)` makes
    it call the boosted model (whose forward the plugin hooks: FSDP's gathers, Gemini's chunks);
    until then it calls the PEFT model itself."""

    def __init__(self, peft_model: nn.Module) -> None:
        if not is_lora(peft_model):
            raise ValueError("DisabledAdapter needs the LoRA (peft) model")
        self.module = peft_model  # `unwrap_model` finds the PEFT model (and its config) here
        self.target: nn.Module = peft_model

    def bind(self, boosted: nn.Module) -> None:
        self.target = boosted

    @property
    def config(self):
        return self.module.config

    def parameters(self):
        return self.module.parameters()

    def eval(self) -> "DisabledAdapter":
        return self  # the reference is only ever called under no_grad; train/eval mode is the model's

    def __call__(self, *args, **kwargs):
        with self.module.disable_adapter():
            return self.target(*args, **kwargs)


def bind_reference(reference: Any, model: nn.Module) -> None:
    """Point a `DisabledAdapter` reference at the boosted model when that model is the reference's
    own (GRPO, DPO); nothing for a separate reference, or for PPO, whose reference is the actor
    inside the boosted actor-critic (it calls the actor itself)."""
    from phalanx.booster.plugins.base import unwrap_model

    if isinstance(reference, DisabledAdapter) and unwrap_model(model) is reference.module:
        reference.bind(model)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2's DTensors, one at a time


def lora_part(model: nn.Module, submodule: str = "") -> nn.Module | None:
    """The LoRA (peft) model that is `model` itself (boosted or not) or, with `submodule`, that
    submodule of it (PPO's `actor` inside the actor-critic); None when it has no adapters."""
    from phalanx.booster.plugins.base import unwrap_model

    inner = unwrap_model(model)
    if is_lora(inner):
        return inner
    part = inner.get_submodule(submodule) if submodule else None
    return part if part is not None and is_lora(part) else None


def merged_engine_weights(model: nn.Module, submodule: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, tensor) of the LoRA `model` (boosted or not) — or of its LoRA `submodule`, named
    inside it — with the adapter merged into each adapted weight (W + scaling·B·A,
    `phalanx.booster.lora.merged_pairs`: new tensors, the base is not touched), one tensor at a
    time, for `LLM.load_weights`. Under FSDP2 a collective (each DTensor is gathered as it comes)."""
    from phalanx.booster.lora import merged_pairs
    from phalanx.booster.plugins.base import unwrap_model

    whole = unwrap_model(model)
    pairs = ((name, _full(t.detach())) for name, t in whole.state_dict().items())
    if is_lora(whole):
        yield from inside(merged_pairs(whole, pairs), submodule)
    else:  # the adapters are on the submodule: its tensors, named inside it, merged by it
        yield from merged_pairs(whole.get_submodule(submodule), inside(pairs, submodule))


class _MergedShards:
    """A LoRA policy's merged shards standing in for a module's `state_dict()` where
    `tp_shard_source` reads it: each read of `items()` / `values()` merges again, one layer's
    tensors at a time (`merged_pairs` streams), so no merged copy of the whole shard is ever held;
    the merges (rank-r products) are repeated instead, a small cost beside a sync."""

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    def _pairs(self):
        from phalanx.booster.lora import merged_pairs
        return merged_pairs(self.policy, ((n, t.detach()) for n, t in self.policy.state_dict().items()))

    def state_dict(self) -> "_MergedShards":
        return self

    def items(self):
        return self._pairs()

    def values(self):
        return (tensor for _, tensor in self._pairs())


def merged_tp_shards(policy: nn.Module, plan) -> tuple[_MergedShards, Any]:
    """This rank's shards of the LoRA `policy` with the adapter merged (W_r + scaling·B_r·A_r), named
    as the base model's weights and merged as they are read, and `plan` (the trainer's `TPPlan`)
    renamed to match, for `phalanx.inference.weights.tp_shard_source`. No communication: tensor
    parallelism splits each adapter with its base (`phalanx.shard.lora_tp`: B by output rows under a
    column-parallel base, A by input columns under a row-parallel one, both whole beside replicated
    key/value heads), so each rank's merge is exactly its shard of the merged weight."""
    import dataclasses

    from phalanx.booster.lora import PEFT_PREFIX

    merged = _MergedShards(policy)
    params = {}
    for name, _ in merged.items():
        layer, _, leaf = name.rpartition(".")
        for trained in (PEFT_PREFIX + name, f"{PEFT_PREFIX}{layer}.base_layer.{leaf}"):
            if trained in plan.params:
                params[name] = plan.params[trained]
                break
    return merged, dataclasses.replace(plan, params=params)


class SubmoduleLoRAExport(PolicyExport):
    """fit hook of a run whose policy is a LoRA `submodule` of the trained model (PPO's actor inside
    its actor-critic): `adapter/` (the policy's adapter in PEFT's format, with the tokenizer) or, with
    `merge=True`, `policy/` (the merged policy, a plain Hugging Face directory). Collective: every
    rank walks the plugin's gather; rank 0 writes."""

    def __init__(self, policy: nn.Module, tokenizer: Any, submodule: str, merge: bool = False) -> None:
        super().__init__(policy, tokenizer, submodule)
        self.merge = merge
        self.name = MERGED_DIR if merge else ADAPTER_DIR

    def save(self, directory: Path) -> None:
        from phalanx.booster.lora import write_lora_pairs

        from .export import policy_tensors
        writer = not dist.is_initialized() or dist.get_rank() == 0
        write_lora_pairs(self.policy, policy_tensors(self.model, self.submodule), Path(directory), writer=writer,
                         merge=self.merge, tokenizer=self.tokenizer)


class LoRAExport(PolicyExport):
    """fit hook of a LoRA run: `adapter/` (PEFT format, with the tokenizer) in every checkpoint, or with
    `merge=True` `policy/` (the merged model, a plain Hugging Face directory). Collective: every rank
    walks the plugin's gather; rank 0 writes. Holds no training state (binding and loading are
    `PolicyExport`'s)."""

    def __init__(self, tokenizer: Any, merge: bool = False) -> None:
        super().__init__(None, tokenizer)
        self.merge = merge
        self.name = MERGED_DIR if merge else ADAPTER_DIR

    def save(self, directory: Path) -> None:
        from phalanx.booster.lora import save_lora
        from phalanx.booster.state import boosted_state
        state = boosted_state(self.model)
        writer = not dist.is_initialized() or dist.get_rank() == 0
        save_lora(state.plugin, state.module, Path(directory), writer=writer, merge=self.merge,
                  tokenizer=self.tokenizer)


def lora_hooks(lora: LoRASettings, tokenizer: Any) -> list[LoRAExport]:
    """The export hooks of the `lora:` section: adapter/ always, policy/ with `merge`."""
    if not lora.enabled:
        return []
    return [LoRAExport(tokenizer)] + ([LoRAExport(tokenizer, merge=True)] if lora.merge else [])


def prepare(model: nn.Module, lora: LoRASettings, checkpointing: bool, seed: int = 0) -> nn.Module:
    """The model `fit` will train: with the `lora:` adapters (initialised from `seed`, so a run's
    adapters do not depend on what drew random numbers before it) and activation checkpointing."""
    if lora.enabled:
        torch.manual_seed(seed)
    model = with_lora(model, lora)
    activation_checkpointing(model, checkpointing)
    return model


# -- the command: merge an adapter afterwards -----------------------------------------------------
def find_adapter(path: str | Path) -> Path:
    """The adapter directory `path` names: itself, a checkpoint's adapter/, or the latest checkpoint's
    adapter/ of a training output_dir."""
    from phalanx.checkpoint.train_state import latest_checkpoint
    p = Path(path).expanduser()
    candidates = [p, p / ADAPTER_DIR]
    ckpt = latest_checkpoint(p) if p.is_dir() else None
    if ckpt is not None:
        candidates.append(Path(ckpt) / ADAPTER_DIR)
    for c in candidates:
        if (c / "adapter_config.json").is_file():
            return c
    raise FileNotFoundError(f"no LoRA adapter at {str(p)!r}: looked for adapter_config.json in "
                            + ", ".join(str(c) for c in candidates) + " (train with lora.enabled=true first)")


def merge_adapter(adapter: str | Path, out: str | Path, base: str | None = None) -> Path:
    """Merge the PEFT adapter at `adapter` into its base (`base`, else the adapter config's
    base_model_name_or_path: a directory or a Hub id in the local cache) with peft's
    `merge_and_unload`, and save a plain Hugging Face directory with the tokenizer at `out`."""
    from phalanx.booster.lora import import_peft

    from .models import load_policy, load_tokenizer

    peft = import_peft()
    adapter = find_adapter(adapter)
    base = base or json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter}/adapter_config.json names no base model: pass --base DIR")
    model = peft.PeftModel.from_pretrained(load_policy(base), str(adapter)).merge_and_unload()
    out = Path(out)
    model.save_pretrained(str(out), safe_serialization=True)
    if (adapter / "tokenizer_config.json").is_file():  # the run saved its tokenizer beside the adapter
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(str(adapter))
    else:
        tokenizer = load_tokenizer(base)
    tokenizer.save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Merge a LoRA run's adapter (PEFT format) into its base model.")
    parser.add_argument("adapter", help="the adapter directory, a checkpoint, or a training output_dir")
    parser.add_argument("--merge", action="store_true", required=True, help="write the merged model (required)")
    parser.add_argument("--out", required=True, help="directory for the merged Hugging Face model")
    parser.add_argument("--base", default=None, help="base model (default: the adapter config's base)")
    args = parser.parse_args(argv)
    print(merge_adapter(args.adapter, args.out, args.base))


if __name__ == "__main__":
    main(sys.argv[1:])
